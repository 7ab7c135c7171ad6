# dtp-serve's chat page (chat_page/index.html) compiled into the binary, so an
# installed dtp-serve needs no data files: the page becomes a raw string
# literal in a generated header, rewritten (and dtp-serve rebuilt) when the
# page changes. Included by apps/CMakeLists.txt after dtp-serve's target.
set(_dtp_chat_page ${CMAKE_CURRENT_LIST_DIR}/index.html)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_dtp_chat_page})
file(READ ${_dtp_chat_page} DTP_CHAT_PAGE_HTML)
if(DTP_CHAT_PAGE_HTML MATCHES "\\)dtp_chat_page\"")
  message(FATAL_ERROR "dtp: ${_dtp_chat_page} contains the raw string's closing delimiter )dtp_chat_page\"")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/chat_page_html.h.in ${CMAKE_CURRENT_BINARY_DIR}/dtp-serve-gen/chat_page_html.h @ONLY)
target_sources(dtp-serve PRIVATE ${CMAKE_CURRENT_LIST_DIR}/../chat_page.cpp)
target_include_directories(dtp-serve PRIVATE ${CMAKE_CURRENT_BINARY_DIR}/dtp-serve-gen)
