// libdtp_sentencepiece.so: Debian's libsentencepiece behind the C interface
// of sentencepiece_shim.h. Built as a MODULE and loaded with dlmopen only
// (NOTE: [Sentencepiece in its own namespace] in tokenizer.cpp). Nothing here
// may throw across the interface: each entry catches and reports.
#include "text/sentencepiece_shim.h"

#include <sentencepiece_processor.h>

#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace {

using sentencepiece::SentencePieceProcessor;

const SentencePieceProcessor& sp(const void* model) { return *static_cast<const SentencePieceProcessor*>(model); }

void report(DtpSpmSink error, void* ctx, const std::string& message) { error(ctx, message.data(), message.size()); }

template <typename F>
int guarded(DtpSpmSink error, void* ctx, F&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    report(error, ctx, std::string("exception in libsentencepiece: ") + e.what());
  } catch (...) {
    report(error, ctx, "unknown exception in libsentencepiece");
  }
  return 1;
}

int load(const char* path, void** model, DtpSpmSink error, void* ctx) {
  return guarded(error, ctx, [&] {
    auto processor = std::make_unique<SentencePieceProcessor>();
    const auto status = processor->Load(path);
    if (!status.ok()) {
      report(error, ctx, status.error_message());
      return 1;
    }
    *model = processor.release();
    return 0;
  });
}

void release(void* model) { delete static_cast<SentencePieceProcessor*>(model); }

int encode(const void* model, const char* text, size_t size, DtpSpmSink ids, DtpSpmSink error, void* ctx) {
  return guarded(error, ctx, [&] {
    std::vector<int> out;
    const auto status = sp(model).Encode(std::string_view(text, size), &out);
    if (!status.ok()) {
      report(error, ctx, status.error_message());
      return 1;
    }
    static_assert(sizeof(int) == sizeof(int32_t));
    ids(ctx, out.data(), out.size() * sizeof(int32_t));
    return 0;
  });
}

int decode(const void* model, const int32_t* ids, size_t count, DtpSpmSink text, DtpSpmSink error, void* ctx) {
  return guarded(error, ctx, [&] {
    std::string out;
    const auto status = sp(model).Decode(std::vector<int>(ids, ids + count), &out);
    if (!status.ok()) {
      report(error, ctx, status.error_message());
      return 1;
    }
    text(ctx, out.data(), out.size());
    return 0;
  });
}

int32_t pieceSize(const void* model) { return sp(model).GetPieceSize(); }
int32_t bosId(const void* model) { return sp(model).bos_id(); }
int32_t eosId(const void* model) { return sp(model).eos_id(); }

int pieceKind(const void* model, int32_t id) {
  const SentencePieceProcessor& p = sp(model);
  if (p.IsUnknown(id)) return kDtpSpmUnknown;
  if (p.IsControl(id)) return kDtpSpmControl;
  if (p.IsUnused(id)) return kDtpSpmUnused;
  if (p.IsByte(id)) return kDtpSpmByte;
  return kDtpSpmNormal;
}

void piece(const void* model, int32_t id, DtpSpmSink out, void* ctx) {
  const std::string& p = sp(model).IdToPiece(id);
  out(ctx, p.data(), p.size());
}

const DtpSpmApi kApi = {DTP_SPM_API_VERSION, load,  release, encode,    decode,
                        pieceSize,           bosId, eosId,   pieceKind, piece};

}  // namespace

extern "C" __attribute__((visibility("default"))) const DtpSpmApi* dtp_spm_api(void) { return &kApi; }
