// Moved: KVCache lives in dtp/inference/kv_cache.h (library dtp::inference,
// which dtp::models links), in namespace dtp::inference; dtp::models::KVCache
// still names it. This stub stays for one release (NOTE: [Moved headers] in
// dtp/models/tokenizer.h).
#pragma once

#ifndef DTP_NO_DEPRECATED
#if defined(__GNUC__) && !defined(__clang__)
#pragma message("dtp/models/kv_cache.h moved to dtp/inference/kv_cache.h (target dtp::inference, which " \
    "dtp::models links); this stub goes in the next release. Include the new path, " \
    "then define DTP_NO_DEPRECATED to build as the next release will (CHANGELOG.md)")
#endif
#include "dtp/inference/kv_cache.h"
#else
#error "dtp/models/kv_cache.h moved to dtp/inference/kv_cache.h (target dtp::inference): include that (CHANGELOG.md)"
#endif  // DTP_NO_DEPRECATED
