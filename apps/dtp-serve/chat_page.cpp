#include "chat_page.h"

#include "chat_page_html.h"  // generated: see chat_page/embed.cmake

#include <httplib.h>

namespace dtp::serve {

void register_chat_page(httplib::Server& server) {
  const auto page = [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-cache");  // a rebuilt server serves its own page
    res.set_content(kChatPageHtml, sizeof(kChatPageHtml) - 1, "text/html; charset=utf-8");
  };
  server.Get("/", page);
  server.Get("/index.html", page);
}

}  // namespace dtp::serve
