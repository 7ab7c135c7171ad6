// The C interface of libdtp_sentencepiece.so, the module that wraps Debian's
// libsentencepiece for SentencePieceTokenizer. Only C types cross it: the
// module runs in a link namespace of its own, with its own C++ runtime
// (NOTE: [Sentencepiece in its own namespace] in tokenizer.cpp), so no
// std::string, exception or allocation may pass between the two sides.
#pragma once

#include <stddef.h>
#include <stdint.h>

extern "C" {

// Receives a result or an error message: `size` bytes at `data`, valid only
// during the call.
typedef void (*DtpSpmSink)(void* ctx, const void* data, size_t size);

enum DtpSpmPieceKind { kDtpSpmNormal = 0, kDtpSpmUnknown = 1, kDtpSpmControl = 2, kDtpSpmUnused = 3, kDtpSpmByte = 4 };

#define DTP_SPM_API_VERSION 1

// Functions returning int give 0 on success; otherwise they have passed a
// message to `error`. Ids are sentencepiece's int32.
struct DtpSpmApi {
  int version;  // DTP_SPM_API_VERSION
  int (*load)(const char* path, void** model, DtpSpmSink error, void* ctx);
  void (*release)(void* model);
  // `ids` receives count * sizeof(int32_t) bytes.
  int (*encode)(const void* model, const char* text, size_t size, DtpSpmSink ids, DtpSpmSink error, void* ctx);
  int (*decode)(const void* model, const int32_t* ids, size_t count, DtpSpmSink text, DtpSpmSink error, void* ctx);
  int32_t (*piece_size)(const void* model);
  int32_t (*bos_id)(const void* model);  // -1: none
  int32_t (*eos_id)(const void* model);  // -1: none
  int (*piece_kind)(const void* model, int32_t id);  // a DtpSpmPieceKind
  void (*piece)(const void* model, int32_t id, DtpSpmSink out, void* ctx);  // e.g. "▁the", "<0xE2>"
};

// The module's one exported symbol.
const DtpSpmApi* dtp_spm_api(void);

}  // extern "C"
