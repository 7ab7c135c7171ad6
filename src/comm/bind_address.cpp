#include "comm/bind_address.h"

#include "comm/job_env.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>

namespace dtp::detail {

// NOTE: [Choosing the interface] Gloo binds each rank's transport to one
// local address and tells its peers that address; a rank bound to loopback
// on a host of a multi-host job gets "connect [127.0.0.1]: Connection
// refused" from every peer elsewhere. The choice, first match wins:
//
//   1. ProcessGroupOptions::bind_address, when the program set it;
//   2. DTP_BIND_ADDR: an address (or several, comma-separated);
//   3. GLOO_SOCKET_IFNAME: a comma-separated list of interfaces, one Gloo
//      device each, as c10d reads it (NCCL's NCCL_SOCKET_IFNAME is NCCL's
//      own and passes through untouched);
//   4. MASTER_ADDR resolves to loopback: a one-host job, loopback;
//   5. the hostname's address, if it is not loopback and can be bound (as
//      c10d's createDefaultDevice);
//   6. where c10d would fall back to loopback (Debian maps the hostname to
//      127.0.1.1, containers to 127.0.0.1): this host's address on the route
//      to MASTER_ADDR, said on stderr with the variable that chooses;
//   7. loopback, with a warning naming GLOO_SOCKET_IFNAME.
//
// The choice is made once, in init_process_group, so that every group of
// the job binds alike.

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::vector<std::string> splitCommas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

bool isLoopback(const sockaddr* a) {
  if (a->sa_family == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr) >> 24) == 127;
  if (a->sa_family == AF_INET6) return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
  return false;
}

bool isLinkLocal6(const sockaddr* a) {
  return a->sa_family == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
}

std::string numeric(const sockaddr* a) {
  char buf[INET6_ADDRSTRLEN] = {};
  const void* src = a->sa_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(a)->sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
  return inet_ntop(a->sa_family, src, buf, sizeof buf) != nullptr ? std::string(buf) : std::string();
}

using AddrList = std::unique_ptr<addrinfo, decltype(&freeaddrinfo)>;

AddrList resolve(const std::string& host, int socktype) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socktype;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) res = nullptr;
  return AddrList(res, &freeaddrinfo);
}

bool canBind(const sockaddr* a, socklen_t len) {
  const int fd = socket(a->sa_family, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_storage copy{};
  std::memcpy(&copy, a, len);
  // Port 0: any free port; only whether the address is this host's matters.
  if (a->sa_family == AF_INET) reinterpret_cast<sockaddr_in*>(&copy)->sin_port = 0;
  else reinterpret_cast<sockaddr_in6*>(&copy)->sin6_port = 0;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&copy), len) == 0;
  close(fd);
  return ok;
}

std::string hostname() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

// Said once per process, and only by the first rank of a node, so that a
// node's ranks do not repeat it.
void sayOnce(const std::string& message) {
  static std::atomic<bool> said{false};
  const auto local = local_rank();
  if ((!local || *local == 0) && !said.exchange(true)) std::cerr << message << "\n";
}

std::string join(const std::vector<std::string>& parts, const char* sep = ",") {
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : sep) + p;
  return s;
}

}  // namespace

std::vector<std::string> interface_addresses(const std::vector<std::string>& names) {
  ifaddrs* all = nullptr;
  TORCH_CHECK(getifaddrs(&all) == 0, "dtp: cannot list this host's interfaces for GLOO_SOCKET_IFNAME: ",
              std::strerror(errno), ". Set DTP_BIND_ADDR to this host's address instead.");
  std::unique_ptr<ifaddrs, decltype(&freeifaddrs)> guard(all, &freeifaddrs);
  std::vector<std::string> known, out;
  for (ifaddrs* i = all; i != nullptr; i = i->ifa_next)
    if (std::find(known.begin(), known.end(), i->ifa_name) == known.end()) known.emplace_back(i->ifa_name);
  for (const auto& name : names) {
    TORCH_CHECK(std::find(known.begin(), known.end(), name) != known.end(), "dtp: GLOO_SOCKET_IFNAME names interface '",
                name, "': got no such interface on this host, expected one of ", join(known, ", "),
                ". Set it to the interface on the network that joins the hosts.");
    std::string v4, v6;
    for (ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
      if (name != i->ifa_name || i->ifa_addr == nullptr) continue;
      if (i->ifa_addr->sa_family == AF_INET && v4.empty()) v4 = numeric(i->ifa_addr);
      if (i->ifa_addr->sa_family == AF_INET6 && v6.empty() && !isLinkLocal6(i->ifa_addr)) v6 = numeric(i->ifa_addr);
    }
    TORCH_CHECK(!v4.empty() || !v6.empty(), "dtp: GLOO_SOCKET_IFNAME names interface '", name,
                "': got an interface without an address, expected one with an IPv4 or IPv6 address. "
                "Bring it up, or name another interface.");
    out.push_back(!v4.empty() ? v4 : v6);
  }
  return out;
}

std::optional<std::string> hostname_address() {
  auto list = resolve(hostname(), SOCK_STREAM);
  for (addrinfo* a = list.get(); a != nullptr; a = a->ai_next)
    if (!isLoopback(a->ai_addr) && !isLinkLocal6(a->ai_addr) && canBind(a->ai_addr, a->ai_addrlen))
      return numeric(a->ai_addr);
  return std::nullopt;
}

bool resolves_to_loopback(const std::string& host) {
  auto list = resolve(host, SOCK_STREAM);
  if (!list) return false;
  for (addrinfo* a = list.get(); a != nullptr; a = a->ai_next)
    if (!isLoopback(a->ai_addr)) return false;
  return true;
}

std::optional<std::string> route_address(const std::string& host) {
  auto list = resolve(host, SOCK_DGRAM);
  for (addrinfo* a = list.get(); a != nullptr; a = a->ai_next) {
    // A UDP "connect" sends nothing; it only picks the route and so the source address.
    const int fd = socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage to{};
    std::memcpy(&to, a->ai_addr, a->ai_addrlen);
    if (a->ai_family == AF_INET) reinterpret_cast<sockaddr_in*>(&to)->sin_port = htons(9);
    else reinterpret_cast<sockaddr_in6*>(&to)->sin6_port = htons(9);
    sockaddr_storage self{};
    socklen_t len = sizeof self;
    const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&to), a->ai_addrlen) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) == 0;
    close(fd);
    if (ok && !isLoopback(reinterpret_cast<sockaddr*>(&self))) return numeric(reinterpret_cast<sockaddr*>(&self));
  }
  return std::nullopt;
}

std::string choose_bind_address(const std::string& master_addr) {
  if (auto a = env("DTP_BIND_ADDR")) return *a;
  if (auto names = env("GLOO_SOCKET_IFNAME")) {
    const auto list = splitCommas(*names);
    TORCH_CHECK(!list.empty(), "dtp: GLOO_SOCKET_IFNAME='", *names,
                "': got no interface name, expected a comma-separated list like 'eth0' or 'eth0,eth1'. Fix or unset it.");
    return join(interface_addresses(list));
  }
  if (resolves_to_loopback(master_addr)) return "127.0.0.1";
  if (auto a = hostname_address()) return *a;
  if (auto a = route_address(master_addr)) {
    sayOnce("dtp: the hostname '" + hostname() + "' resolves to no address other hosts can reach; Gloo binds to " +
            *a + ", this host's address on the route to MASTER_ADDR=" + master_addr +
            ". Set GLOO_SOCKET_IFNAME to choose the interface.");
    return *a;
  }
  sayOnce("dtp: warning: Gloo binds to loopback (127.0.0.1): the hostname '" + hostname() +
          "' resolves to no address other hosts can reach and no route to MASTER_ADDR=" + master_addr +
          " was found, so ranks on other hosts cannot connect. Set GLOO_SOCKET_IFNAME to the interface that joins "
          "the hosts (e.g. GLOO_SOCKET_IFNAME=eth0), or DTP_BIND_ADDR to this host's address.");
  return "127.0.0.1";
}

}  // namespace dtp::detail
