// Incremental detokenization for streaming: the text each generated token
// settles, at a cost per token bounded by a small window of ids instead of
// the whole sequence (Hugging Face tokenizers' DecodeStream; vLLM's
// prefix_offset/read_offset detokenizer).
//
//   DecodeStream stream(tokenizer, /*skip_special_tokens=*/true);
//   for (int64_t id : generated) send(stream.step(id));   // "" while text is held
//   send(stream.flush());                                  // at the end
//
// The pieces concatenate to tokenizer.decode(generated, skip_special_tokens)
// exactly, byte for byte, for every tokenizer kind of tokenizer.h (see NOTE:
// [Decode stream window]). So decode's contract holds: a sentencepiece
// text's first token loses its leading space ("▁Hello" -> "Hello"), as
// decode(generated ids) has it. The prompt is deliberately not part of the
// window: seeding it with the prompt's last ids, as vLLM does, would give
// " Hello", the continuation of the prompt, which is another contract.
#pragma once

#include "dtp/text/tokenizer.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dtp::models {

// NOTE: [Decode stream window]
// How it works (vLLM's algorithm, with exact rules for when text is held):
//  - The window holds the ids from prefix_offset on; the first read_offset
//    of them are context whose text, prefix_text = decode(context), was
//    sent already. On a new id, if the text is not held (below), the window
//    is decoded and what follows prefix_text is sent: decode(window) minus
//    decode(context). Then the window keeps only its last kContextIds ids
//    with visible text (decode_token not ""), and more while their decode
//    is "", which become the context.
//    A send decodes two windows of about kContextIds + 1 ids.
//  - Held (nothing sent, nothing decoded, the window grows) while
//     (a) the bytes of the ids so far (decode_token's) end inside a UTF-8
//         character: a lead byte without all its continuation bytes
//         (lenient: surrogates and overlong forms count too), e.g. E4 B8 of
//         中 split over byte tokens; at most 3 more bytes decide it;
//     (b) for a tokenizer whose byte-fallback runs decode all or nothing
//         (Hugging Face's ByteFallback decoder, Llama 2's tokenizer.json:
//         <0xE4><0x41> gives "\uFFFD\uFFFD", the valid "A" included), the last
//         id is a byte-fallback id: a later byte of the run can still turn
//         the run's characters into U+FFFD. The run is sent when a non-byte
//         id ends it. Sentencepiece itself decodes byte pieces character by
//         character (<0xE4><0x41> gives "\uFFFDA"): (a) is enough there.
//    A held step costs O(1); a U+FFFD from bytes that can no longer form a
//    character is sent at once, not held as vLLM does.
// Why it is exact: the pieces sum to decode(all ids) when, at every send,
//  (1) decode(ids up to the send) is a prefix of decode(any longer ids):
//      decode is a function of the bytes that repairs only invalid UTF-8
//      (from_utf8_lossy, sentencepiece's per-byte U+FFFD, ByteFallback's
//      per-run rule) and ByteTokenizer repairs nothing; (a) and (b) hold the
//      text exactly while later ids can still change it;
//  (2) decode(window) - decode(context) == decode(all) - decode(all but the
//      new ids): the decoders' rules are per token (Replace, ByteLevel's
//      byte map, Metaspace's "▁"), per settled byte run, or positional at
//      the start of the text (sentencepiece drops the first piece's "▁",
//      Hugging Face's Metaspace decoder the first token's, Strip(start) after
//      Fuse the first characters): the context starts with the same ids in
//      both decodes, and its decode is not "", so the start rules stopped
//      inside it (Strip stops at a character it keeps or after its count,
//      the others touch the first visible id only): they cancel. A window
//      that starts inside a UTF-8 character decodes its first bytes to
//      U+FFFD in both decodes and resynchronizes at the first lead byte
//      (the send point is settled); Strip(stop) at the end is the same in
//      both.
// Special tokens: with skip_special_tokens, an HfTokenizer's special ids are
// dropped before the window, as its decode drops them before the decoder. A
// skipped sentencepiece control id decodes to nothing but ends a byte run
// (<0xE4></s><0xB8><0xAD> is three U+FFFD, not 中): it joins the window while
// text is held, and is dropped between settled texts, where it changes
// nothing ("▁x" after it still loses its space at the start), so that a run
// of them cannot grow the window. Hugging Face transformers' clean_up_tokenization_spaces, which is
// not local (" ." -> "."), is not part of HfTokenizer::decode and so not here.
// Fall back: for a Tokenizer subclass other than ByteTokenizer,
// SentencePieceTokenizer and HfTokenizer (a user's own), the stream cannot
// know that its decode is local and DECODES ALL IDS AT EVERY SEND (O(sequence)
// per token, as before), still holding by (a): exact for a decode whose text
// of a prefix is a prefix of the longer text, as TextStream required.
// local() says which path a stream takes.
class DecodeStream {
 public:
  // Visible ids of context kept before the new ones (NOTE: [Decode stream window]).
  static constexpr size_t kContextIds = 4;

  // `tokenizer` must outlive the stream.
  DecodeStream(const Tokenizer& tokenizer, bool skip_special_tokens);

  // The text that `id` settles: "" while text is held. An id outside
  // [0, vocab_size()) is an error (the caller drops a model's padded ids, as
  // dtp-serve does), as is a step after flush().
  std::string step(int64_t id);
  // Ends the stream: the text still held (U+FFFD for a cut character, as
  // decode gives it).
  std::string flush();

  // Whether the stream decodes a bounded window (true) or all ids (the fall
  // back for an unknown Tokenizer subclass).
  bool local() const { return local_; }
  // Ids in the window now (context and held ids): bounded by kContextIds + 1
  // after a send, for tests and the benchmark.
  size_t window_size() const { return ids_.size(); }

 private:
  bool held(int64_t id, const std::string& bytes);
  void keepContext();

  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  bool local_ = true;
  bool drop_special_ = false;              // an HfTokenizer skipping special ids
  std::vector<bool> byte_fallback_;        // ids of all-or-nothing byte runs, by id
  std::vector<int64_t> ids_;               // the window
  std::vector<char> visible_;              // per window id: decode_token gave bytes
  std::string prefix_text_;                // decode of the window's context
  size_t read_ = 0;                        // ids_[0, read_) is the context
  std::string tail_;                       // the last <= 3 bytes of the ids so far
  bool holding_ = false;                   // the last step held its text
  bool flushed_ = false;
};

}  // namespace dtp::models
