// What a rank derives from its launcher's environment (Slurm, mpirun) and
// which address its Gloo transport binds to. No communication: these are the
// decisions init_process_group makes before it connects.
#include "comm/bind_address.h"
#include "comm/job_env.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

namespace {

using dtp::detail::first_slurm_host;

// Sets variables for one test and restores them after.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, const char*>& vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      if (value) setenv(name.c_str(), value, 1);
      else unsetenv(name.c_str());
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) setenv(name.c_str(), value->c_str(), 1);
      else unsetenv(name.c_str());
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

// The error text of `f`, or "" when it did not throw.
template <class F>
std::string errorOf(F f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(SlurmEnvTest, FirstHostOfCompressedLists) {
  EXPECT_EQ(first_slurm_host("node[01-03,07],gpu5"), "node01");
  EXPECT_EQ(first_slurm_host("node[07,01-03]"), "node07");  // Slurm keeps the order given
  EXPECT_EQ(first_slurm_host("gpu5,node[1-2]"), "gpu5");
  EXPECT_EQ(first_slurm_host("vm"), "vm");
  EXPECT_EQ(first_slurm_host("n[007]"), "n007");
  EXPECT_EQ(first_slurm_host("rack[1-2]-n[08-09]"), "rack1-n08");
  EXPECT_EQ(first_slurm_host("a-b.example.org"), "a-b.example.org");
}

TEST(SlurmEnvTest, MalformedListsAreNamed) {
  EXPECT_NE(errorOf([] { first_slurm_host("node[01-03"); }).find("'node[01-03': a '[' without its ']'"),
            std::string::npos);
  EXPECT_NE(errorOf([] { first_slurm_host("node01]"); }).find("a ']' without its '['"), std::string::npos);
  EXPECT_NE(errorOf([] { first_slurm_host("n[a-b]"); }).find("not numeric"), std::string::npos);
  EXPECT_NE(errorOf([] { first_slurm_host(",x"); }).find("',x': no first host, expected a list like"), std::string::npos);
}

TEST(SlurmEnvTest, PortFromJobIdsLastFourDigits) {
  EXPECT_EQ(dtp::detail::slurm_master_port("123456"), 18456);
  EXPECT_EQ(dtp::detail::slurm_master_port("7"), 15007);
  EXPECT_EQ(dtp::detail::slurm_master_port("9999"), 24999);
  EXPECT_NE(errorOf([] { dtp::detail::slurm_master_port("12_3a"); }).find("SLURM_JOB_ID='12_3a'"), std::string::npos);
}

TEST(SlurmEnvTest, MasterAddrFromStepListThenJobList) {
  {
    ScopedEnv env({{"SLURM_STEP_NODELIST", "gpu[3-4]"}, {"SLURM_JOB_NODELIST", "gpu[1-4]"}, {"SLURM_NODELIST", nullptr}});
    EXPECT_EQ(dtp::detail::slurm_master_addr(), "gpu3");
  }
  {
    ScopedEnv env({{"SLURM_STEP_NODELIST", nullptr}, {"SLURM_JOB_NODELIST", "gpu[1-4]"}, {"SLURM_NODELIST", "x"}});
    EXPECT_EQ(dtp::detail::slurm_master_addr(), "gpu1");
  }
  {
    ScopedEnv env({{"SLURM_STEP_NODELIST", nullptr}, {"SLURM_JOB_NODELIST", nullptr}, {"SLURM_NODELIST", nullptr}});
    EXPECT_EQ(dtp::detail::slurm_master_addr(), std::nullopt);
  }
}

TEST(JobEnvTest, LocalRankFromTorchrunMpirunOrSrun) {
  std::string from;
  {
    ScopedEnv env({{"LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"SLURM_LOCALID", "3"}});
    EXPECT_EQ(dtp::detail::local_rank(&from), 1);
    EXPECT_EQ(from, "LOCAL_RANK");
  }
  {
    ScopedEnv env({{"LOCAL_RANK", nullptr}, {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"SLURM_LOCALID", "3"}});
    EXPECT_EQ(dtp::detail::local_rank(&from), 2);
    EXPECT_EQ(from, "OMPI_COMM_WORLD_LOCAL_RANK");
  }
  {
    ScopedEnv env({{"LOCAL_RANK", nullptr}, {"OMPI_COMM_WORLD_LOCAL_RANK", nullptr}, {"SLURM_LOCALID", "3"}});
    EXPECT_EQ(dtp::detail::local_rank(&from), 3);
    EXPECT_EQ(from, "SLURM_LOCALID");
  }
  {
    ScopedEnv env({{"LOCAL_RANK", nullptr}, {"OMPI_COMM_WORLD_LOCAL_RANK", nullptr}, {"SLURM_LOCALID", nullptr}});
    EXPECT_EQ(dtp::detail::local_rank(), std::nullopt);
  }
  {
    ScopedEnv env({{"LOCAL_RANK", nullptr}, {"OMPI_COMM_WORLD_LOCAL_RANK", nullptr}, {"SLURM_LOCALID", "-1"}});
    EXPECT_NE(errorOf([] { dtp::detail::local_rank(); }).find("SLURM_LOCALID='-1' is not a rank on this node"),
              std::string::npos);
  }
}

TEST(BindAddressTest, GlooSocketIfnameListsInterfaces) {
  ScopedEnv env({{"DTP_BIND_ADDR", nullptr}, {"GLOO_SOCKET_IFNAME", "lo"}});
  EXPECT_EQ(dtp::detail::choose_bind_address("10.213.0.1"), "127.0.0.1");
  setenv("GLOO_SOCKET_IFNAME", "lo,lo", 1);
  EXPECT_EQ(dtp::detail::choose_bind_address("10.213.0.1"), "127.0.0.1,127.0.0.1");
}

TEST(BindAddressTest, UnknownInterfaceIsNamedWithTheKnownOnes) {
  ScopedEnv env({{"DTP_BIND_ADDR", nullptr}, {"GLOO_SOCKET_IFNAME", "lo,nosuch0"}});
  const std::string e = errorOf([] { dtp::detail::choose_bind_address("10.213.0.1"); });
  EXPECT_NE(e.find("GLOO_SOCKET_IFNAME names interface 'nosuch0': got no such interface on this host, expected one of "),
            std::string::npos) << e;
  EXPECT_NE(e.find("lo"), std::string::npos) << e;
  setenv("GLOO_SOCKET_IFNAME", ",", 1);
  EXPECT_NE(errorOf([] { dtp::detail::choose_bind_address("10.213.0.1"); }).find("got no interface name"),
            std::string::npos);
}

TEST(BindAddressTest, DtpBindAddrWinsOverGlooSocketIfname) {
  ScopedEnv env({{"DTP_BIND_ADDR", "10.213.0.9"}, {"GLOO_SOCKET_IFNAME", "nosuch0"}});
  EXPECT_EQ(dtp::detail::choose_bind_address("10.213.0.1"), "10.213.0.9");
}

TEST(BindAddressTest, LoopbackMasterMeansLoopback) {
  ScopedEnv env({{"DTP_BIND_ADDR", nullptr}, {"GLOO_SOCKET_IFNAME", nullptr}});
  EXPECT_TRUE(dtp::detail::resolves_to_loopback("localhost"));
  EXPECT_TRUE(dtp::detail::resolves_to_loopback("127.0.0.1"));
  EXPECT_TRUE(dtp::detail::resolves_to_loopback("::1"));
  EXPECT_FALSE(dtp::detail::resolves_to_loopback("10.213.0.1"));
  EXPECT_EQ(dtp::detail::choose_bind_address("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(dtp::detail::choose_bind_address("localhost"), "127.0.0.1");
  EXPECT_EQ(dtp::detail::route_address("127.0.0.1"), std::nullopt);
}

}  // namespace
