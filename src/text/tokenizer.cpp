#include "dtp/text/tokenizer.h"

#include "dtp/text/hf_tokenizer.h"

#include "text/sentencepiece_shim.h"

#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace dtp::models {
namespace {

namespace fs = std::filesystem;

constexpr const char* kSupported =
    "supported: a Hugging Face tokenizer.json (Llama 2/3, Mistral, Qwen 2.5/3), a sentencepiece tokenizer.model "
    "(Llama 1/2, Mistral), or byte-level (the default)";

// "▁" (U+2581), sentencepiece's visible space.
constexpr const char* kSpaceSymbol = "\xE2\x96\x81";

void checkIdInVocab(const char* component, int64_t id, int64_t vocab_size, const std::string& name) {
  TORCH_CHECK(id >= 0 && id < vocab_size, component, ": token id out of range for tokenizer ", name, ": got ", id,
              ", expected 0 <= id < ", vocab_size, ". The ids come from another tokenizer or a model with a larger "
              "vocabulary.");
}

std::string readPrefix(const fs::path& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes(max_bytes, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(max_bytes));
  bytes.resize(static_cast<size_t>(in.gcount()));
  return bytes;
}

// Llama 3's original/tokenizer.model is tiktoken's text format, one
// "<base64 token> <rank>" per line (e.g. "IQ== 0"), not a sentencepiece proto.
bool looksLikeTiktoken(const std::string& head) {
  const std::string line = head.substr(0, head.find('\n'));
  const size_t space = line.find(' ');
  if (space == 0 || space == std::string::npos || space + 1 == line.size()) return false;
  const auto base64 = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' || c == '=';
  };
  const auto digit = [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; };
  return std::all_of(line.begin(), line.begin() + space, base64) &&
         std::all_of(line.begin() + space + 1, line.end(), digit);
}

// A Hugging Face fast tokenizer (tokenizer.json): a JSON object.
bool looksLikeJson(const fs::path& path, const std::string& head) {
  if (path.extension() == ".json") return true;
  const auto first =
      std::find_if(head.begin(), head.end(), [](char c) { return !std::isspace(static_cast<unsigned char>(c)); });
  return first != head.end() && *first == '{';
}

// Rejects the formats we know are not sentencepiece models, each by name, so
// that a Llama 3 tokenizer does not read as a "corrupt file".
void checkNotForeignFormat(const fs::path& path) {
  const std::string head = readPrefix(path, 4096);
  TORCH_CHECK(!looksLikeJson(path, head), "SentencePieceTokenizer: unsupported tokenizer for '", path.string(),
              "': got a Hugging Face fast tokenizer (JSON, tokenizer.json), expected a sentencepiece tokenizer.model. "
              "Read it with HfTokenizer (load_tokenizer does); ", kSupported, ".");
  TORCH_CHECK(!looksLikeTiktoken(head), "SentencePieceTokenizer: unsupported tokenizer for '", path.string(),
              "': got a tiktoken BPE file (Llama 3's original/tokenizer.model), expected a sentencepiece "
              "tokenizer.model; ", kSupported, ".");
}

}  // namespace

// --- ByteTokenizer ---

std::vector<int64_t> ByteTokenizer::encode(const std::string& text, bool /*add_bos: no BOS here*/) const {
  std::vector<int64_t> ids(text.size());
  std::transform(text.begin(), text.end(), ids.begin(), [](char c) { return static_cast<unsigned char>(c); });
  return ids;
}

std::string ByteTokenizer::decode_ids(const std::vector<int64_t>& ids, bool /*skip_special_tokens: none*/) const {
  std::string text;
  text.reserve(ids.size());
  for (const int64_t id : ids) {
    checkIdInVocab("ByteTokenizer::decode", id, vocab_size(), name());
    text.push_back(static_cast<char>(id));
  }
  return text;
}

std::string ByteTokenizer::decode_one(int64_t id, bool /*skip_special_tokens: none*/) const {
  checkIdInVocab("ByteTokenizer::decode_token", id, vocab_size(), name());
  return std::string(1, static_cast<char>(id));
}

// --- SentencePieceTokenizer ---

// NOTE: [Sentencepiece in its own namespace]
// Debian's libsentencepiece (0.1.97 in Debian 12, 0.2.0 in 13) carries its
// own protobuf-lite (3.14 in 12) and exports it; Debian's libtorch loads
// libprotobuf (3.21). In one link namespace the first of the two serves both:
// a program linked with both crashes before main, in libprotobuf's start-up
// code running sentencepiece's copy (ReflectionOps::FindInitializationErrors
// under DescriptorPool::InternalAddGeneratedFile). So no dtp binary links
// libsentencepiece. The module libdtp_sentencepiece.so (sentencepiece_shim.cpp)
// does, behind a C interface, and dlmopen loads it into a new namespace with
// its own libsentencepiece, protobuf and C++ runtime. RTLD_DEEPBIND is not
// enough: the module would then write to libstdc++'s own std::cerr, never
// constructed since the program holds a copy-relocated one, and crash on
// sentencepiece's first log line.
namespace {

#ifndef DTP_SENTENCEPIECE_MODULE_BUILD
#define DTP_SENTENCEPIECE_MODULE_BUILD "libdtp_sentencepiece.so"
#endif
#ifndef DTP_SENTENCEPIECE_MODULE_INSTALL
#define DTP_SENTENCEPIECE_MODULE_INSTALL "libdtp_sentencepiece.so"
#endif

// Loaded once per process, never unloaded.
const DtpSpmApi& spmApi() {
  static const DtpSpmApi* api = [] {
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("DTP_SENTENCEPIECE_MODULE"); env && *env) candidates.emplace_back(env);
    for (const char* path : {DTP_SENTENCEPIECE_MODULE_BUILD, DTP_SENTENCEPIECE_MODULE_INSTALL}) {
      if (std::find(candidates.begin(), candidates.end(), path) == candidates.end()) candidates.emplace_back(path);
    }
    std::string tried;
    for (const std::string& path : candidates) {
      void* handle = ::dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) {
        const char* why = ::dlerror();
        tried += "\n  " + path + ": " + (why ? why : "not loadable");
        continue;
      }
      using Entry = const DtpSpmApi* (*)();
      const auto entry = reinterpret_cast<Entry>(::dlsym(handle, "dtp_spm_api"));
      const DtpSpmApi* found = entry ? entry() : nullptr;
      const int version = found ? found->version : -1;
      if (version != DTP_SPM_API_VERSION) ::dlclose(handle);
      TORCH_CHECK(version == DTP_SPM_API_VERSION, "SentencePieceTokenizer: wrong module for sentencepiece at '", path,
                  "': got interface version ", found ? std::to_string(version) : std::string("none"), ", expected ",
                  DTP_SPM_API_VERSION,
                  ". Rebuild dtp (target dtp_sentencepiece) or point DTP_SENTENCEPIECE_MODULE at this dtp's module.");
      return found;
    }
    TORCH_CHECK(false, "SentencePieceTokenizer: no module for sentencepiece: got none of", tried,
                "\nexpected libdtp_sentencepiece.so, which dtp builds beside libdtp (target dtp_sentencepiece) and "
                "installs in its libdir. Build or install it, or set DTP_SENTENCEPIECE_MODULE to its path.");
    return static_cast<const DtpSpmApi*>(nullptr);
  }();
  return *api;
}

// What the module's sinks write into.
struct SpmOut {
  std::string text;
  std::vector<int32_t> ids;
  std::string error;
};

void toText(void* ctx, const void* data, size_t size) {
  static_cast<SpmOut*>(ctx)->text.assign(static_cast<const char*>(data), size);
}
void toIds(void* ctx, const void* data, size_t size) {
  const auto* ids = static_cast<const int32_t*>(data);
  static_cast<SpmOut*>(ctx)->ids.assign(ids, ids + size / sizeof(int32_t));
}
// Sentencepiece's messages may end in a space.
void toError(void* ctx, const void* data, size_t size) {
  const auto* text = static_cast<const char*>(data);
  while (size > 0 && std::isspace(static_cast<unsigned char>(text[size - 1]))) --size;
  static_cast<SpmOut*>(ctx)->error.assign(text, size);
}

}  // namespace

class SentencePieceTokenizer::Model {
 public:
  Model(const DtpSpmApi& api, void* handle) : api(api), handle(handle) {}
  ~Model() { api.release(handle); }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const DtpSpmApi& api;
  void* const handle;
};

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& model_path) : path_(model_path) {
  std::error_code ec;
  TORCH_CHECK(fs::is_regular_file(model_path, ec), "SentencePieceTokenizer: no model file for '", model_path,
              "': got ", fs::exists(model_path, ec) ? "something that is not a regular file" : "a missing path",
              ", expected a sentencepiece tokenizer.model. Check the path.");
  checkNotForeignFormat(model_path);
  const DtpSpmApi& api = spmApi();
  void* handle = nullptr;
  SpmOut out;
  // Sentencepiece's messages ("unk is not defined.", "[model_proto->
  // ParseFromArray(...)]") say what, not where: the file's name and size go
  // with them.
  TORCH_CHECK(api.load(model_path.c_str(), &handle, toError, &out) == 0,
              "SentencePieceTokenizer: cannot load the model for '", model_path, "': got \"", out.error, "\" (",
              fs::file_size(model_path, ec), " bytes), expected a sentencepiece model proto. The file is truncated, "
              "corrupt or of another kind; ", kSupported, ".");
  model_ = std::make_unique<Model>(api, handle);
  // A proto cut at a field boundary can parse; what it lost shows here.
  TORCH_CHECK(vocab_size() > 0, "SentencePieceTokenizer: empty vocabulary for '", model_path,
              "': got 0 pieces, expected at least one. The file is truncated or corrupt: copy it again.");
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int64_t> SentencePieceTokenizer::encode(const std::string& text, bool add_bos) const {
  SpmOut out;
  TORCH_CHECK(model_->api.encode(model_->handle, text.data(), text.size(), toIds, toError, &out) == 0,
              "SentencePieceTokenizer::encode: sentencepiece failed for tokenizer ", name(), ": got \"", out.error,
              "\" on a text of ", text.size(), " bytes.");
  std::vector<int64_t> ids;
  ids.reserve(out.ids.size() + 1);
  if (add_bos && bos_id()) ids.push_back(*bos_id());
  ids.insert(ids.end(), out.ids.begin(), out.ids.end());
  return ids;
}

std::string SentencePieceTokenizer::decode_ids(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const int64_t vocab = vocab_size();
  for (const int64_t id : ids) checkIdInVocab("SentencePieceTokenizer::decode", id, vocab, name());
  // Sentencepiece decodes control pieces to nothing. Kept, each is its piece
  // between the decoded runs of the others: {1, "▁Hello"} gives "<s>Hello", as
  // Hugging Face's (slow) LlamaTokenizer. Its fast tokenizer, which a
  // tokenizer.json runs (HfTokenizer), gives "<s> Hello".
  std::string text;
  std::vector<int32_t> run;
  const auto flush = [&] {
    if (run.empty()) return;
    SpmOut out;
    TORCH_CHECK(model_->api.decode(model_->handle, run.data(), run.size(), toText, toError, &out) == 0,
                "SentencePieceTokenizer::decode: sentencepiece failed for tokenizer ", name(), ": got \"", out.error,
                "\" on ", run.size(), " ids.");
    text += out.text;
    run.clear();
  };
  run.reserve(ids.size());
  for (const int64_t id : ids) {
    const auto i = static_cast<int32_t>(id);
    if (!skip_special_tokens && model_->api.piece_kind(model_->handle, i) == kDtpSpmControl) {
      flush();
      SpmOut piece;
      model_->api.piece(model_->handle, i, toText, &piece);
      text += piece.text;
    } else {
      run.push_back(i);
    }
  }
  flush();
  return text;
}

std::string SentencePieceTokenizer::decode_one(int64_t id, bool skip_special_tokens) const {
  checkIdInVocab("SentencePieceTokenizer::decode_token", id, vocab_size(), name());
  const auto i = static_cast<int32_t>(id);
  const int kind = model_->api.piece_kind(model_->handle, i);
  if (kind == kDtpSpmControl && skip_special_tokens) return "";
  if (kind == kDtpSpmUnknown) return decode({id});  // the model's unk surface, " ⁇ " by default
  SpmOut out;
  model_->api.piece(model_->handle, i, toText, &out);
  const std::string& piece = out.text;
  if (kind == kDtpSpmControl) return piece;  // "<s>"
  if (kind == kDtpSpmByte) {  // "<0xE2>"
    TORCH_INTERNAL_ASSERT(piece.size() == 6, "byte piece '", piece, "' of ", name());
    return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
  }
  std::string text;
  for (size_t at = 0; at < piece.size();) {
    if (piece.compare(at, 3, kSpaceSymbol) == 0) {
      text.push_back(' ');
      at += 3;
    } else {
      text.push_back(piece[at++]);
    }
  }
  return text;
}

int64_t SentencePieceTokenizer::vocab_size() const { return model_->api.piece_size(model_->handle); }

std::optional<int64_t> SentencePieceTokenizer::bos_id() const {
  const int32_t id = model_->api.bos_id(model_->handle);
  return id >= 0 ? std::optional<int64_t>(id) : std::nullopt;
}

std::optional<int64_t> SentencePieceTokenizer::eos_id() const {
  const int32_t id = model_->api.eos_id(model_->handle);
  return id >= 0 ? std::optional<int64_t>(id) : std::nullopt;
}

// --- load_tokenizer ---

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  if (path.empty() || path == "byte") return std::make_unique<ByteTokenizer>();
  std::error_code ec;
  const fs::path p(path);
  TORCH_CHECK(fs::exists(p, ec), "load_tokenizer: no tokenizer for '", path,
              "': got a missing path, expected a tokenizer.json or tokenizer.model file or a Hugging Face model "
              "folder holding one. Check the path; ", kSupported, ".");
  if (fs::is_directory(p, ec)) {
    // Hugging Face's AutoTokenizer takes the fast tokenizer when there is one.
    const fs::path json = p / "tokenizer.json";
    if (fs::exists(json, ec)) return std::make_unique<HfTokenizer>(json.string());
    const fs::path model = p / "tokenizer.model";
    TORCH_CHECK(fs::exists(model, ec), "load_tokenizer: no tokenizer in folder '", path,
                "': got neither tokenizer.json nor tokenizer.model, expected one of them in it; ", kSupported, ".");
    return std::make_unique<SentencePieceTokenizer>(model.string());
  }
  if (fs::is_regular_file(p, ec) && looksLikeJson(p, readPrefix(p, 4096))) return std::make_unique<HfTokenizer>(path);
  return std::make_unique<SentencePieceTokenizer>(path);
}

void check_tokenizer_fits_model(const Tokenizer& tokenizer, int64_t model_vocab_size, const std::string& model) {
  TORCH_CHECK(tokenizer.vocab_size() <= model_vocab_size, "tokenizer: vocabulary mismatch between the tokenizer (",
              tokenizer.name(), ") and the model (", model, "): got token ids up to ", tokenizer.vocab_size() - 1,
              ", expected ids below the model's vocab_size ", model_vocab_size, ". Use the model's own tokenizer "
              "(the tokenizer.json or tokenizer.model of its folder).");
}

}  // namespace dtp::models
