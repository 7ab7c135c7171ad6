#include "corpus.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

namespace dtp::apps {

at::Tensor load_corpus(const std::string& path, const models::Tokenizer* tokenizer) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path))
      if (e.is_regular_file() && e.path().extension() != ".dat" && e.path().extension() != ".u8")
        files.push_back(e.path());
    std::sort(files.begin(), files.end());
  } else if (fs::is_regular_file(path, ec)) {
    files.push_back(path);
  }
  TORCH_CHECK(!files.empty(), "dtp-train: no text at '", path, "'. Install the default corpus with "
              "`apt-get install fortunes` (scripts/setup.sh does), or pass --data FILE.");
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (tokenizer != nullptr && tokenizer->name() != "byte") {
    const std::vector<int64_t> ids = tokenizer->encode(text, /*add_bos=*/false);
    return at::tensor(ids, at::kLong);
  }
  at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  std::copy(text.begin(), text.end(), static_cast<char*>(bytes.data_ptr()));
  return bytes.to(at::kLong);
}

at::Tensor corpus_batch(const at::Tensor& tokens, int64_t batch, int64_t seq, uint64_t seed, int64_t step) {
  TORCH_CHECK(tokens.numel() > seq + 1, "dtp-train: the corpus has ", tokens.numel(),
              " tokens, fewer than --seq + 1 = ", seq + 1, ". Use more text or a shorter --seq.");
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003 + static_cast<uint64_t>(step));
  at::Tensor starts = at::randint(tokens.numel() - seq - 1, {batch, 1}, gen, at::kLong);
  return tokens.index({starts + at::arange(seq + 1, at::kLong)});
}

}  // namespace dtp::apps
