// dtp-serve's chat page at / (chat_page/index.html, compiled in): static HTML
// and JS that talk to /v1/chat/completions like any other client.
#pragma once

namespace httplib {
class Server;
}

namespace dtp::serve {

// GET / (and /index.html): the page, text/html.
void register_chat_page(httplib::Server& server);

}  // namespace dtp::serve
