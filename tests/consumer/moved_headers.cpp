// A program written before the tokenizers and chat templates moved to
// dtp::text: their old include paths, the same names, dtp::models linked
// alone (NOTE: [Moved headers] in dtp/models/tokenizer.h). Built without
// DTP_NO_DEPRECATED: each stub forwards, with a note.
#include <dtp/models/chat.h>
#include <dtp/models/hf_tokenizer.h>
#include <dtp/models/tokenizer.h>

#include <iostream>
#include <memory>

int main() {
  const dtp::models::ByteTokenizer bytes;
  const std::vector<int64_t> ids = bytes.encode("moved", /*add_bos=*/false);
  // HfTokenizer through the old path: a folder without tokenizer files is an
  // error naming the folder, from the library dtp::models brings along.
  bool refused = false;
  try {
    std::unique_ptr<dtp::models::Tokenizer> t = dtp::models::load_tokenizer("/nonexistent-dtp-tokenizer");
  } catch (const std::exception& e) {
    refused = std::string(e.what()).find("/nonexistent-dtp-tokenizer") != std::string::npos;
  }
  const dtp::models::ChatMessage message{"user", "hi"};
  const bool ok = ids.size() == 5 && bytes.decode(ids) == "moved" && refused && message.role == "user" &&
                  sizeof(dtp::models::HfTokenizer) > 0;
  std::cout << "moved headers: " << (ok ? "OK" : "FAILED") << "\n";
  return ok ? 0 : 1;
}
