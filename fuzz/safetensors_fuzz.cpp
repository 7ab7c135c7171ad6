// libFuzzer target for the safetensors reader: the header length, the JSON
// header and the tensor index (dtypes, shapes, offsets, checksums). Any bytes
// must load or fail with a c10::Error naming the file: never crash, hang, or
// allocate more than the file could hold. Run with scripts/fuzz.sh.
#include "dtp/io/safetensors.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // load_safetensors reads a path: the input goes to a per-process file in
  // memory-backed /dev/shm.
  static const std::string path = "/dev/shm/dtp_fuzz_" + std::to_string(::getpid()) + ".safetensors";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    dtp::io::load_safetensors(path);
  } catch (const c10::Error&) {
    // A clear error is the expected outcome for most inputs.
  }
  return 0;
}
