// Moved: ChatTemplate, ChatMessage and end_token_ids live in dtp/text/chat.h
// (library dtp::text).
// NOTE: [Moved headers] in dtp/models/tokenizer.h.
#pragma once

#ifndef DTP_NO_DEPRECATED
#if defined(__GNUC__) && !defined(__clang__)
#pragma message("dtp/models/chat.h moved to dtp/text/chat.h (target dtp::text, which " \
    "dtp::models links); this stub goes in the next release. Include the new path, " \
    "then define DTP_NO_DEPRECATED to build as the next release will (CHANGELOG.md)")
#endif
#include "dtp/text/chat.h"
#else
#error "dtp/models/chat.h moved to dtp/text/chat.h (target dtp::text): include that (CHANGELOG.md)"
#endif  // DTP_NO_DEPRECATED
