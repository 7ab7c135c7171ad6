// Moved: Tokenizer, ByteTokenizer, SentencePieceTokenizer and load_tokenizer
// live in dtp/text/tokenizer.h (library dtp::text).
//
// NOTE: [Moved headers] The tokenizers and chat templates moved from
// dtp/models/ to dtp/text/, a library of their own (dtp::text, which
// dtp::models links, so a program linking dtp::models still gets them).
// Their names did not change (namespace dtp::models): a program changes only
// its #include lines. As CHANGELOG.md's deprecation policy says, each old
// header stays for one release as this stub: it includes the new one, and
// with GCC a translation unit that reaches it gets a note (a #pragma message:
// never a warning, so -Werror builds pass; none under Clang, where #pragma
// message is a warning). With DTP_NO_DEPRECATED, as the next release has it
// (dtp's own code builds that way), including it is an error naming the new
// path. See NOTE: [Deprecated forwarding] in dtp/models/llama.h.
#pragma once

#ifndef DTP_NO_DEPRECATED
#if defined(__GNUC__) && !defined(__clang__)
#pragma message("dtp/models/tokenizer.h moved to dtp/text/tokenizer.h (target dtp::text, which " \
    "dtp::models links); this stub goes in the next release. Include the new path, " \
    "then define DTP_NO_DEPRECATED to build as the next release will (CHANGELOG.md)")
#endif
#include "dtp/text/tokenizer.h"
#else
#error "dtp/models/tokenizer.h moved to dtp/text/tokenizer.h (target dtp::text): include that (CHANGELOG.md)"
#endif  // DTP_NO_DEPRECATED
