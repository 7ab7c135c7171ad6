// Which local address(es) the Gloo transport binds to on a job's ranks.
// See NOTE: [Choosing the interface] in bind_address.cpp.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace dtp::detail {

// ProcessGroupOptions::bind_address for a job whose rank 0 is at
// `master_addr`, when the program left it empty: DTP_BIND_ADDR, else the
// addresses of GLOO_SOCKET_IFNAME's interfaces, else as c10d chooses.
// Comma-separated when there are several (one Gloo device each). Says on
// stderr (once per process, on local rank 0) when it falls back to a guess.
std::string choose_bind_address(const std::string& master_addr);

// The address of each named interface (IPv4 first), in order; an error
// naming an interface this host lacks or one without an address.
std::vector<std::string> interface_addresses(const std::vector<std::string>& names);

// The hostname's first address that is not loopback and that this host can
// bind to; none when it resolves only to loopback (Debian's 127.0.1.1) or
// to no local address.
std::optional<std::string> hostname_address();

// Whether `host` (a name or an address) resolves to a loopback address only.
bool resolves_to_loopback(const std::string& host);

// This host's source address on the route to `host`; none when there is no
// route or it goes over loopback.
std::optional<std::string> route_address(const std::string& host);

}  // namespace dtp::detail
