// Moved: HfTokenizer and its options live in dtp/text/hf_tokenizer.h
// (library dtp::text).
// NOTE: [Moved headers] in dtp/models/tokenizer.h.
#pragma once

#ifndef DTP_NO_DEPRECATED
#if defined(__GNUC__) && !defined(__clang__)
#pragma message("dtp/models/hf_tokenizer.h moved to dtp/text/hf_tokenizer.h (target dtp::text, which " \
    "dtp::models links); this stub goes in the next release. Include the new path, " \
    "then define DTP_NO_DEPRECATED to build as the next release will (CHANGELOG.md)")
#endif
#include "dtp/text/hf_tokenizer.h"
#else
#error "dtp/models/hf_tokenizer.h moved to dtp/text/hf_tokenizer.h (target dtp::text): include that (CHANGELOG.md)"
#endif  // DTP_NO_DEPRECATED
