// c10d's Gloo backend, with a check that the gloo headers match the gloo
// compiled into libtorch. Only process_group.cpp includes it: no other file
// of dtp needs gloo's headers.
//
// NOTE: [Gloo headers] Debian's libtorch comes with the matching libgloo-dev
// (Debian 13: gloo 5354032, the pin of torch 2.3 to 2.7). The pip wheel
// ships no gloo headers; scripts/wheel.sh takes them from gloo's git at the
// commit the wheel's torch pins (its table), so that inline code of
// ProcessGroupGloo.hpp and gloo's classes have one layout. A mismatch is
// silent (gloo::Context lost its vtable, Store's and Pair's vtables changed
// between those commits), so what the headers reveal of their version is
// checked against the torch version here. Never link a second gloo
// (Debian's libgloo.so): libtorch has its own inside.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/version.h>

#define DTP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// gloo's common/store.h defines GLOO_SHARED_STORE from gloo 08c094b (torch
// 2.8's pin on); transport/remote_key.h exists from c37d821 (torch 2.9's).
#if DTP_TORCH_AT_LEAST(2, 8) && !defined(GLOO_SHARED_STORE)
#error "dtp: these gloo headers are older than the gloo in this libtorch (torch >= 2.8). Build with scripts/wheel.sh, which takes gloo's headers at the commit this torch pins (NOTE: [Gloo headers] in src/comm/gloo.h)."
#endif
#if DTP_TORCH_AT_LEAST(2, 9) && !__has_include(<gloo/transport/remote_key.h>)
#error "dtp: these gloo headers are older than the gloo in this libtorch (torch >= 2.9). Build with scripts/wheel.sh (NOTE: [Gloo headers] in src/comm/gloo.h)."
#endif
#if !DTP_TORCH_AT_LEAST(2, 8) && defined(GLOO_SHARED_STORE)
#error "dtp: these gloo headers are newer than the gloo in this libtorch (torch < 2.8 pins gloo 5354032 or older). Use the libgloo-dev that matches your libtorch (NOTE: [Gloo headers] in src/comm/gloo.h)."
#endif

#undef DTP_TORCH_AT_LEAST
