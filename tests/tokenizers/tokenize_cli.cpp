// tokenize_cli: dtp's side of the reference test (run_reference.sh).
//   tokenize_cli encode TOKENIZER CORPUS OUT   records of CORPUS (NUL-separated
//       bytes) -> one JSON line per record, {"ids": [...], "text": decode(ids,
//       skip_special_tokens=true), "all": decode(ids, false)}, encoded with
//       add_bos=true (HF's add_special_tokens=True); prints the encode time
//       and tokens/s on stderr.
//   tokenize_cli chat FOLDER CASES OUT   CASES: a JSON list of {"system": s|null,
//       "user": u, "enable_thinking": b?, "date_string": d?}, or with "messages":
//       [{"role", "content"}, ...] in place of system and user (a conversation)
//       -> one JSON line per case,
//       {"text": format(...), "ids": encode(text, add_bos=false), "decoded":
//       decode(ids)} or {"error": ...}.
#include "dtp/text/chat.h"
#include "dtp/text/hf_tokenizer.h"
#include "dtp/text/tokenizer.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

namespace {

using nlohmann::json;

std::string readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "tokenize_cli: cannot read '", path, "'.");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string line(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n"; }

int encodeCorpus(const std::string& tokenizer_path, const std::string& corpus_path, const std::string& out_path) {
  const auto tokenizer = dtp::models::load_tokenizer(tokenizer_path);
  const std::string corpus = readAll(corpus_path);
  std::vector<std::string> records;
  for (size_t at = 0; at <= corpus.size();) {
    const size_t end = std::min(corpus.find('\0', at), corpus.size());
    records.push_back(corpus.substr(at, end - at));
    at = end + 1;
  }
  if (!corpus.empty() && corpus.back() == '\0') records.pop_back();
  std::vector<std::vector<int64_t>> ids(records.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < records.size(); ++i) ids[i] = tokenizer->encode(records[i], /*add_bos=*/true);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  size_t tokens = 0;
  for (const auto& v : ids) tokens += v.size();
  std::ofstream out(out_path, std::ios::binary);
  for (size_t i = 0; i < records.size(); ++i) {
    out << line({{"ids", ids[i]},
                 {"text", tokenizer->decode(ids[i], /*skip_special_tokens=*/true)},
                 {"all", tokenizer->decode(ids[i], /*skip_special_tokens=*/false)}});
  }
  std::fprintf(stderr, "dtp: %zu records, %zu bytes, %zu tokens, encode %.3f s, %.0f tokens/s (1 thread)\n",
               records.size(), corpus.size(), tokens, seconds, tokens / seconds);
  return 0;
}

int chatCases(const std::string& folder, const std::string& cases_path, const std::string& out_path) {
  const auto tokenizer = dtp::models::load_tokenizer(folder);
  const json cases = json::parse(readAll(cases_path));
  std::ofstream out(out_path, std::ios::binary);
  for (const json& c : cases) {
    try {
      const auto chat = dtp::models::ChatTemplate::from_folder(folder);
      std::optional<std::string> date;
      if (c.contains("date_string")) date = c.at("date_string").get<std::string>();
      std::string text;
      if (c.contains("messages")) {  // a conversation: the multi-turn form
        std::vector<dtp::models::ChatMessage> messages;
        for (const json& m : c.at("messages")) messages.push_back({m.at("role"), m.at("content")});
        text = chat.format(messages, c.value("enable_thinking", true), date);
      } else {
        std::optional<std::string> system;
        if (c.contains("system") && !c.at("system").is_null()) system = c.at("system").get<std::string>();
        text = chat.format(system, c.at("user").get<std::string>(), c.value("enable_thinking", true), date);
      }
      const std::vector<int64_t> ids = tokenizer->encode(text, /*add_bos=*/false);
      out << line({{"text", text}, {"ids", ids}, {"decoded", tokenizer->decode(ids, /*skip_special_tokens=*/false)}});
    } catch (const c10::Error& e) {
      out << line({{"error", e.what_without_backtrace()}});
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "encode" && argc == 5) return encodeCorpus(argv[2], argv[3], argv[4]);
    if (mode == "chat" && argc == 5) return chatCases(argv[2], argv[3], argv[4]);
    std::cerr << "usage: tokenize_cli encode TOKENIZER CORPUS OUT | chat FOLDER CASES OUT\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "tokenize_cli: " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "tokenize_cli: " << e.what() << "\n";
  }
  return 1;
}
