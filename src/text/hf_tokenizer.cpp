// HfTokenizer: tokenizer.json read into the stages of src/text/hf/ and run
// in Hugging Face's order (TokenizerImpl::encode_single_sequence): added
// tokens, normalizer, added tokens of the normalized text, pre-tokenizer,
// model, post-processor.
#include "dtp/text/hf_tokenizer.h"

#include "text/hf/bpe.h"
#include "text/hf/pipeline.h"
#include "text/hf/regex.h"
#include "text/hf/unicode_text.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <unordered_map>

namespace dtp::models {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using hf::Piece;

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

// Unicode White_Space, what HF's lstrip/rstrip (Rust's char::is_whitespace)
// strip: the reference's \s.
bool isWhiteSpace(char32_t c) { return hf::in_class(hf::CharClass::kWhiteSpace, c); }

// Finds added tokens in a text as Hugging Face's AddedVocabulary::find_matches:
// non-overlapping, leftmost first and longest there (Aho-Corasick
// LeftmostLongest), with each token's single_word / lstrip / rstrip.
class AddedMatcher {
 public:
  void add(const std::string& pattern, size_t token) {
    int node = 0;
    for (const char c : pattern) {
      const auto b = static_cast<unsigned char>(c);
      int child = childOf(node, b);
      if (child < 0) {
        child = static_cast<int>(nodes_.size());
        nodes_.emplace_back();
        nodes_[static_cast<size_t>(node)].next.emplace_back(b, child);
      }
      node = child;
    }
    nodes_[static_cast<size_t>(node)].token = static_cast<int>(token);
    first_bytes_[static_cast<unsigned char>(pattern[0])] = true;
    empty_ = false;
  }
  bool empty() const { return empty_; }

  // Appends the pieces of `text`: added tokens (token >= 0) and the text
  // between them; empty text pieces are dropped.
  void split(const std::string& text, bool at_start, const std::vector<AddedToken>& tokens,
             const hf::Pattern* word_char, std::vector<Piece>& out) const {
    size_t emitted = 0;  // HF's start_offset
    size_t from = 0;
    while (from < text.size()) {
      size_t start = 0, stop = 0;
      int token = -1;
      for (size_t i = from; i < text.size() && token < 0; ++i) {
        if (!first_bytes_[static_cast<unsigned char>(text[i])]) continue;
        int node = 0;
        for (size_t k = i; k < text.size(); ++k) {
          node = childOf(node, static_cast<unsigned char>(text[k]));
          if (node < 0) break;
          if (nodes_[static_cast<size_t>(node)].token >= 0) {
            token = nodes_[static_cast<size_t>(node)].token;
            start = i;
            stop = k + 1;
          }
        }
      }
      if (token < 0) break;
      from = stop;  // the next match starts after this one, taken or not
      const AddedToken& t = tokens[static_cast<size_t>(token)];
      if (t.single_word) {
        const bool word_before = start > 0 && word_char->contains(lastChar(text, start));
        const bool word_after = stop < text.size() && word_char->contains(firstChar(text, stop));
        if (word_before || word_after) continue;
      }
      if (t.lstrip) {
        size_t s = start;
        while (s > 0) {
          size_t p = s - 1;
          while (p > 0 && (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80) --p;
          if (!isWhiteSpace(hf::code_point_at(text, p))) break;
          s = p;
        }
        start = std::max(s, emitted);
      }
      if (t.rstrip) {
        while (stop < text.size() && isWhiteSpace(hf::code_point_at(text, stop))) {
          stop += hf::utf8_length(static_cast<unsigned char>(text[stop]));
        }
      }
      if (emitted < start) out.push_back({text.substr(emitted, start - emitted), at_start && emitted == 0, -1});
      out.push_back({text.substr(start, stop - start), at_start && start == 0, t.id});
      emitted = stop;
    }
    if (emitted < text.size()) out.push_back({text.substr(emitted), at_start && emitted == 0, -1});
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int>> next;
    int token = -1;
  };
  int childOf(int node, unsigned char b) const {
    for (const auto& [c, child] : nodes_[static_cast<size_t>(node)].next) {
      if (c == b) return child;
    }
    return -1;
  }
  static std::string_view lastChar(const std::string& text, size_t end) {
    size_t p = end - 1;
    while (p > 0 && (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80) --p;
    return std::string_view(text).substr(p, end - p);
  }
  static std::string_view firstChar(const std::string& text, size_t at) {
    return std::string_view(text).substr(at, hf::utf8_length(static_cast<unsigned char>(text[at])));
  }

  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_bytes_{};
  bool empty_ = true;
};

json readJson(const std::string& path, const char* what) {
  std::error_code ec;
  TORCH_CHECK(fs::is_regular_file(path, ec), "HfTokenizer: no ", what, " at '", path, "': got ",
              fs::exists(path, ec) ? "something that is not a regular file" : "a missing path", ", expected a file. "
              "Check the path.");
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "HfTokenizer: cannot read '", path, "'. Check its permissions.");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    TORCH_CHECK(false, "HfTokenizer: bad JSON in '", path, "' (", fs::file_size(path, ec), " bytes): got \"", e.what(),
                "\", expected a complete ", what, ". The file is truncated or corrupt: download it again.");
  }
  return {};
}

// "<s>" or {"content": "<s>", ...} (tokenizer_config.json's AddedToken form).
std::optional<std::string> tokenText(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j.at("content").is_string()) return j.at("content").get<std::string>();
  return std::nullopt;
}

}  // namespace

struct HfTokenizer::Impl {
  std::string path;
  std::unique_ptr<hf::Bpe> model;
  std::unique_ptr<hf::Normalizer> normalizer;
  std::unique_ptr<hf::PreTokenizer> pre_tokenizer;
  std::unique_ptr<hf::PostProcessor> post_processor;
  std::unique_ptr<hf::Decoder> decoder;
  std::vector<AddedToken> added;
  std::unordered_map<std::string, size_t> added_by_content;
  std::unordered_map<int32_t, size_t> added_by_id;
  AddedMatcher raw_matcher, normalized_matcher;
  std::unique_ptr<hf::Pattern> word_char;  // \w, for single_word tokens
  int64_t vocab_size = 0;
  std::optional<int64_t> bos, eos;

  std::optional<int32_t> idOf(const std::string& token) const {
    if (const auto it = added_by_content.find(token); it != added_by_content.end()) return added[it->second].id;
    return model->token_to_id(token);
  }
  const AddedToken* addedOf(int64_t id) const {
    const auto it = added_by_id.find(static_cast<int32_t>(id));
    return it == added_by_id.end() ? nullptr : &added[it->second];
  }
  // The token's text, or an error for an id no token has.
  const std::string& tokenOf(int64_t id, const char* who) const {
    TORCH_CHECK(id >= 0 && id < vocab_size, who, ": token id out of range for tokenizer.json ", path, ": got ", id,
                ", expected 0 <= id < ", vocab_size, ". The ids come from another tokenizer or a model with a larger "
                "vocabulary.");
    if (const AddedToken* a = addedOf(id)) return a->content;
    const auto& tokens = model->id_to_token();
    TORCH_CHECK(static_cast<size_t>(id) < tokens.size() && !tokens[static_cast<size_t>(id)].empty(), who,
                ": no token has id ", id, " in tokenizer.json ", path, ": got a gap in its ids, expected the id of a "
                "token. The ids come from another tokenizer.");
    return tokens[static_cast<size_t>(id)];
  }

  void readModel(const json& j);
  void readAddedTokens(const json& j);
  void readConfig();
};

void HfTokenizer::Impl::readModel(const json& j) {
  std::string type = j.is_object() && j.contains("type") ? hf::string_field(j, "type", "model", path) : "";
  if (type.empty() && j.is_object() && j.contains("merges")) type = "BPE";  // files older than the "type" field
  TORCH_CHECK(type == "BPE", "HfTokenizer: unsupported model in '", path, "': got \"",
              type.empty() ? std::string("(no type)") : type, "\", expected \"BPE\" (Llama 2/3, Mistral, Qwen). NYI: "
              "Unigram (T5, ALBERT), WordPiece (BERT) and WordLevel models.");
  const json& dropout = j.contains("dropout") ? j.at("dropout") : json();
  TORCH_CHECK(dropout.is_null() || (dropout.is_number() && dropout.get<double>() == 0.0),
              "HfTokenizer: unsupported BPE in '", path, "': got dropout ", dropout.dump(), ", expected null. NYI: "
              "BPE dropout (a training-time randomization).");
  const json& vocab_json = hf::field(j, "vocab", "model", path);
  TORCH_CHECK(vocab_json.is_object(), "HfTokenizer: bad vocab in '", path, "': got ", vocab_json.type_name(),
              ", expected an object of token -> id. The file is corrupt.");
  std::unordered_map<std::string, int32_t> vocab;
  vocab.reserve(vocab_json.size());
  for (const auto& [token, id] : vocab_json.items()) {
    TORCH_CHECK(id.is_number_integer(), "HfTokenizer: bad vocab in '", path, "': got ", id.dump(), " for '", token,
                "', expected an integer id. The file is corrupt.");
    vocab.emplace(token, id.get<int32_t>());
  }
  // Merges: "a b" (older files) or ["a", "b"] (tokenizers >= 0.20, Qwen 3).
  std::vector<std::pair<std::string, std::string>> merges;
  const json& merges_json = j.contains("merges") ? j.at("merges") : json::array();
  TORCH_CHECK(merges_json.is_array(), "HfTokenizer: bad merges in '", path, "': got ", merges_json.type_name(),
              ", expected a list. The file is corrupt.");
  merges.reserve(merges_json.size());
  for (const json& m : merges_json) {
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      TORCH_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                  "HfTokenizer: bad merge ", merges.size(), " in '", path, "': got \"", s, "\", expected two tokens "
                  "separated by one space. The file is corrupt.");
      merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else {
      TORCH_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(), "HfTokenizer: bad merge ",
                  merges.size(), " in '", path, "': got ", m.dump().substr(0, 100), ", expected \"a b\" or [\"a\", "
                  "\"b\"]. The file is corrupt.");
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    }
  }
  hf::BpeOptions o;
  if (j.contains("unk_token") && !j.at("unk_token").is_null()) o.unk_token = hf::string_field(j, "unk_token", "BPE", path);
  o.fuse_unk = hf::bool_field(j, "fuse_unk", false, "BPE", path);
  o.byte_fallback = hf::bool_field(j, "byte_fallback", false, "BPE", path);
  o.ignore_merges = hf::bool_field(j, "ignore_merges", false, "BPE", path);
  for (const auto& [key, out] : {std::make_pair("continuing_subword_prefix", &o.continuing_subword_prefix),
                                 std::make_pair("end_of_word_suffix", &o.end_of_word_suffix)}) {
    if (j.contains(key) && !j.at(key).is_null()) *out = hf::string_field(j, key, "BPE", path);
  }
  model = std::make_unique<hf::Bpe>(std::move(vocab), merges, std::move(o), path);
}

// Hugging Face's AddedVocabulary::add_tokens over the file's list, in order:
// a token the vocabulary holds keeps that id, a new one takes the next id
// after the model's (the file's "id" is checked, as HF warns, not used).
void HfTokenizer::Impl::readAddedTokens(const json& list) {
  TORCH_CHECK(list.is_array(), "HfTokenizer: bad added_tokens in '", path, "': got ", list.type_name(),
              ", expected a list. The file is corrupt.");
  // HF starts at the model's get_vocab_size(): its number of entries.
  int32_t next_id = 0;
  for (const auto& t : model->id_to_token()) next_id += t.empty() ? 0 : 1;
  for (const json& j : list) {
    AddedToken t;
    t.content = hf::string_field(j, "content", "added_tokens", path);
    if (t.content.empty()) continue;
    t.special = hf::bool_field(j, "special", false, "added_tokens", path);
    t.single_word = hf::bool_field(j, "single_word", false, "added_tokens", path);
    t.lstrip = hf::bool_field(j, "lstrip", false, "added_tokens", path);
    t.rstrip = hf::bool_field(j, "rstrip", false, "added_tokens", path);
    t.normalized = hf::bool_field(j, "normalized", !t.special, "added_tokens", path);
    const std::optional<int32_t> known = idOf(t.content);
    t.id = known ? *known : next_id++;
    if (j.contains("id") && j.at("id").is_number_integer() && j.at("id").get<int32_t>() != t.id) {
      TORCH_WARN("HfTokenizer: added token '", t.content, "' of '", path, "' says id ", j.at("id").get<int32_t>(),
                 " but takes id ", t.id, ", as in Hugging Face's tokenizers.");
    }
    if (const auto it = added_by_content.find(t.content); it != added_by_content.end()) {
      added[it->second] = t;  // the same content again: its new flags
      continue;
    }
    added_by_content.emplace(t.content, added.size());
    added_by_id[t.id] = added.size();
    added.push_back(t);
  }
  for (size_t i = 0; i < added.size(); ++i) {
    AddedToken& t = added[i];
    if (t.normalized && normalizer) {
      std::string pattern = t.content;
      normalizer->normalize(pattern);
      if (!pattern.empty()) normalized_matcher.add(pattern, i);
    } else {
      raw_matcher.add(t.content, i);
    }
    if (t.single_word && !word_char) word_char = std::make_unique<hf::Pattern>(hf::Pattern::regex("^\\w", path));
  }
}

void HfTokenizer::Impl::readConfig() {
  const fs::path config = fs::path(path).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  const std::vector<int32_t> prefix = post_processor ? post_processor->prefix() : std::vector<int32_t>();
  if (!prefix.empty()) bos = prefix.front();
  if (!fs::is_regular_file(config, ec)) return;
  const json j = readJson(config.string(), "tokenizer_config.json");
  const auto lookup = [&](const char* key, std::optional<int64_t>& out) {
    if (!j.contains(key)) return;
    out.reset();
    const std::optional<std::string> text = tokenText(j.at(key));
    if (!text) return;  // null: none (Qwen has no BOS)
    const std::optional<int32_t> id = idOf(*text);
    TORCH_CHECK(id.has_value(), "HfTokenizer: unknown ", key, " in '", config.string(), "': got '", *text,
                "', which '", path, "' has no token for. The two files are of different models.");
    out = *id;
  };
  lookup("bos_token", bos);
  lookup("eos_token", eos);
}

HfTokenizer::HfTokenizer(const std::string& tokenizer_json) {
  auto impl = std::make_unique<Impl>();
  impl->path = tokenizer_json;
  const std::string& path = impl->path;
  const json j = readJson(path, "tokenizer.json");
  TORCH_CHECK(j.is_object(), "HfTokenizer: bad tokenizer.json '", path, "': got a JSON ", j.type_name(),
              ", expected an object. The file is corrupt or not a tokenizer.");
  if (j.contains("version")) {
    TORCH_CHECK(j.at("version") == "1.0", "HfTokenizer: unsupported tokenizer.json '", path, "': got version ",
                j.at("version").dump(), ", expected \"1.0\" (as Hugging Face's tokenizers).");
  }
  for (const char* key : {"truncation", "padding"}) {
    TORCH_CHECK(!j.contains(key) || j.at(key).is_null(), "HfTokenizer: unsupported ", key, " in '", path, "': got ",
                j.at(key).dump().substr(0, 200), ", expected null. NYI: truncation and padding inside tokenizer.json.");
  }
  impl->readModel(hf::field(j, "model", "tokenizer.json", path));
  impl->normalizer = hf::make_normalizer(j.value("normalizer", json()), path);
  impl->pre_tokenizer = hf::make_pre_tokenizer(j.value("pre_tokenizer", json()), path);
  impl->post_processor = hf::make_post_processor(j.value("post_processor", json()), path);
  impl->decoder = hf::make_decoder(j.value("decoder", json()), path);
  impl->readAddedTokens(j.value("added_tokens", json::array()));
  int64_t max_id = static_cast<int64_t>(impl->model->id_to_token().size()) - 1;
  for (const AddedToken& t : impl->added) max_id = std::max<int64_t>(max_id, t.id);
  impl->vocab_size = max_id + 1;
  impl->readConfig();
  impl_ = std::move(impl);
}

HfTokenizer::~HfTokenizer() = default;

std::vector<int64_t> HfTokenizer::encode(const std::string& text, bool add_bos) const {
  const Impl& m = *impl_;
  // See NOTE: [Invalid UTF-8 becomes U+FFFD]
  const std::string valid = hf::is_valid_utf8(text) ? text : hf::to_valid_utf8(text);
  std::vector<Piece> pieces;
  if (m.raw_matcher.empty()) {
    if (!valid.empty()) pieces.push_back({valid, true, -1});
  } else {
    m.raw_matcher.split(valid, /*at_start=*/true, m.added, m.word_char.get(), pieces);
  }
  if (m.normalizer) {
    std::vector<Piece> normalized;
    normalized.reserve(pieces.size());
    for (Piece& p : pieces) {
      if (p.token >= 0) {
        normalized.push_back(std::move(p));
        continue;
      }
      m.normalizer->normalize(p.text);
      if (m.normalized_matcher.empty()) {
        if (!p.text.empty()) normalized.push_back(std::move(p));
      } else {
        m.normalized_matcher.split(p.text, p.at_start, m.added, m.word_char.get(), normalized);
      }
    }
    pieces = std::move(normalized);
  }
  if (m.pre_tokenizer) m.pre_tokenizer->pre_tokenize(pieces);
  std::vector<int32_t> ids;
  ids.reserve(valid.size() / 3 + 2);
  for (const Piece& p : pieces) {
    if (p.token >= 0) {
      ids.push_back(p.token);
    } else {
      m.model->tokenize(p.text, ids);
    }
  }
  if (add_bos && m.post_processor) m.post_processor->process(ids);
  return std::vector<int64_t>(ids.begin(), ids.end());
}

std::string HfTokenizer::decode_ids(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  // As HF's TokenizerImpl::decode: the kept tokens, special ones included,
  // go through the decoder together ("<s>" then "▁Hi" gives "<s> Hi": the
  // Strip decoder sees the fused text, which starts with '<').
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int64_t id : ids) {
    const std::string& token = m.tokenOf(id, "HfTokenizer::decode");
    const AddedToken* a = m.addedOf(id);
    if (a == nullptr || !a->special || !skip_special_tokens) tokens.push_back(token);
  }
  std::string text;
  if (m.decoder) {
    m.decoder->decode_chain(tokens);
    for (const std::string& t : tokens) text += t;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
  }
  return text;
}

std::string HfTokenizer::decode_one(int64_t id, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::string token = m.tokenOf(id, "HfTokenizer::decode_token");
  if (const AddedToken* a = m.addedOf(id); a != nullptr && a->special && skip_special_tokens) return "";
  if (m.decoder) m.decoder->stream(token);
  return token;
}

int64_t HfTokenizer::vocab_size() const { return impl_->vocab_size; }
std::optional<int64_t> HfTokenizer::bos_id() const { return impl_->bos; }
std::optional<int64_t> HfTokenizer::eos_id() const { return impl_->eos; }
std::string HfTokenizer::name() const { return "tokenizer.json " + impl_->path; }
const std::string& HfTokenizer::path() const { return impl_->path; }

std::optional<int64_t> HfTokenizer::token_to_id(const std::string& token) const {
  const auto id = impl_->idOf(token);
  return id ? std::optional<int64_t>(*id) : std::nullopt;
}

bool HfTokenizer::is_special(int64_t id) const {
  const AddedToken* a = impl_->addedOf(id);
  return a != nullptr && a->special;
}

}  // namespace dtp::models
