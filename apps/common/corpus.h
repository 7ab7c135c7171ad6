// Text corpus for dtp-train: byte-level tokens (vocab 256) by default, or
// the ids of a model's tokenizer (--init-from-hf with a tokenizer.model).
#pragma once

#include "dtp/text/tokenizer.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace dtp::apps {

// Where setup installs the default corpus (Debian's `fortunes` package;
// CMake's DTP_DEFAULT_CORPUS where it was unpacked elsewhere: scripts/wheel.sh).
#ifndef DTP_DEFAULT_CORPUS
#define DTP_DEFAULT_CORPUS "/usr/share/games/fortunes"
#endif
inline const char* kDefaultCorpus = DTP_DEFAULT_CORPUS;

// Reads `path` (a file, or every plain-text file of a directory in name
// order, skipping the .dat indexes and subdirectories) as i64 tokens: bytes,
// or `tokenizer`'s ids.
at::Tensor load_corpus(const std::string& path, const models::Tokenizer* tokenizer = nullptr);

// Batch `step` of `batch` windows of seq+1 tokens at offsets drawn from
// (seed, step): the same on every rank and in every run.
at::Tensor corpus_batch(const at::Tensor& tokens, int64_t batch, int64_t seq, uint64_t seed, int64_t step);

}  // namespace dtp::apps
