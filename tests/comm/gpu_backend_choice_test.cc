// ChooseGpuBackend over the whole decision table (gpu_backend_choice.h), on
// made-up probes: no GPU needed. Also the box-local settings merge of
// comm_factory.h and the factory's refusal of GPU backends for CPU ranks.
#include "worker/comm/gpu_backend_choice.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/comm_factory.h"

namespace exl3serve::worker::comm {
namespace {

using ::testing::HasSubstr;

// n ranks; host[r] names rank r's host, gpu[r] its bus id; full peer access
// unless `access` is given.
GpuGroupProbe Probe(std::vector<std::string> hosts, std::vector<std::string> gpus) {
  GpuGroupProbe p;
  p.host_ids = std::move(hosts);
  p.pci_bus_ids = std::move(gpus);
  const size_t n = p.host_ids.size();
  p.can_access.assign(n, std::vector<bool>(n, true));
  return p;
}

GpuGroupProbe OneHost(int n) {
  std::vector<std::string> hosts(n, "boxA/1"), gpus;
  for (int r = 0; r < n; ++r) gpus.push_back("0000:0" + std::to_string(r) + ":00.0");
  return Probe(hosts, gpus);
}

GpuBackendPolicy Policy(std::string requested, std::string fallback = "host_staged",
                        bool nccl_built = true, bool allow_shared = false) {
  GpuBackendPolicy p;
  p.requested = std::move(requested);
  p.no_p2p_fallback = std::move(fallback);
  p.nccl_built = nccl_built;
  p.allow_shared_device = allow_shared;
  return p;
}

GpuBackend Chosen(const GpuGroupProbe& probe, const GpuBackendPolicy& policy) {
  absl::StatusOr<GpuBackendChoice> c = ChooseGpuBackend(probe, policy);
  EXPECT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c.ok() && c->reason.empty());
  return c.ok() ? c->backend : GpuBackend::kHostStaged;
}

TEST(GpuBackendChoiceTest, AutoOnOneHostWithPeerAccessEverywhereIsCudaP2p) {
  for (int n : {1, 2, 3, 5, 8}) {
    absl::StatusOr<GpuBackendChoice> c = ChooseGpuBackend(OneHost(n), Policy("auto"));
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->backend, GpuBackend::kCudaP2p) << n;
    EXPECT_THAT(c->reason, HasSubstr("auto"));
  }
}

TEST(GpuBackendChoiceTest, AutoWithoutPeerAccessFallsBackAsConfigured) {
  GpuGroupProbe p = OneHost(3);
  p.can_access[2][0] = false;  // one direction of one pair is enough
  absl::StatusOr<GpuBackendChoice> c = ChooseGpuBackend(p, Policy("auto"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->backend, GpuBackend::kHostStaged);
  EXPECT_THAT(c->reason, HasSubstr("rank 0"));
  EXPECT_THAT(c->reason, HasSubstr("rank 2"));
  EXPECT_EQ(Chosen(p, Policy("auto", "nccl")), GpuBackend::kNccl);
  // nccl configured but not built: host_staged, saying why.
  c = ChooseGpuBackend(p, Policy("auto", "nccl", /*nccl_built=*/false));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->backend, GpuBackend::kHostStaged);
  EXPECT_THAT(c->reason, HasSubstr("not built"));
}

TEST(GpuBackendChoiceTest, AutoWithMoreThanEightRanksOnOneHostFallsBack) {
  EXPECT_EQ(Chosen(OneHost(9), Policy("auto")), GpuBackend::kHostStaged);
  EXPECT_EQ(Chosen(OneHost(9), Policy("auto", "nccl")), GpuBackend::kNccl);
}

TEST(GpuBackendChoiceTest, AutoWithASharedGpuIsHostStagedUnlessAllowed) {
  GpuGroupProbe p = Probe({"h", "h", "h"}, {"0000:01:00.0", "0000:02:00.0", "0000:01:00.0"});
  // The shared pair's (ignored) access entries are false, the rest true.
  p.can_access[0][2] = p.can_access[2][0] = false;
  EXPECT_EQ(Chosen(p, Policy("auto")), GpuBackend::kHostStaged);
  EXPECT_EQ(Chosen(p, Policy("auto", "nccl")), GpuBackend::kHostStaged);
  EXPECT_EQ(Chosen(p, Policy("auto", "host_staged", true, /*allow_shared=*/true)),
            GpuBackend::kCudaP2p);
}

TEST(GpuBackendChoiceTest, AutoAcrossHostsIsNcclOrUnimplementedWithoutIt) {
  GpuGroupProbe p = Probe({"a", "a", "b"}, {"0000:01:00.0", "0000:02:00.0", "0000:01:00.0"});
  // The same bus id on different hosts is not a shared GPU.
  EXPECT_EQ(Chosen(p, Policy("auto")), GpuBackend::kNccl);
  absl::StatusOr<GpuBackendChoice> c = ChooseGpuBackend(p, Policy("auto", "host_staged", false));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(c.status().message(), HasSubstr("without NCCL"));
  // A shared GPU on one of several hosts: NCCL cannot take it.
  p.pci_bus_ids[1] = p.pci_bus_ids[0];
  c = ChooseGpuBackend(p, Policy("auto"));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(), HasSubstr("ranks 0 and 1 share GPU"));
}

TEST(GpuBackendChoiceTest, ExplicitCudaP2pIsCheckedAgainstTheGroup) {
  EXPECT_EQ(Chosen(OneHost(4), Policy("cuda_p2p")), GpuBackend::kCudaP2p);
  GpuGroupProbe p = OneHost(4);
  p.can_access[1][3] = false;
  EXPECT_EQ(ChooseGpuBackend(p, Policy("cuda_p2p")).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(ChooseGpuBackend(OneHost(9), Policy("cuda_p2p")).status().code(),
            absl::StatusCode::kUnimplemented);
  GpuGroupProbe two_hosts = Probe({"a", "b"}, {"x", "y"});
  EXPECT_EQ(ChooseGpuBackend(two_hosts, Policy("cuda_p2p")).status().code(),
            absl::StatusCode::kUnimplemented);
  GpuGroupProbe shared = Probe({"a", "a"}, {"x", "x"});
  EXPECT_EQ(ChooseGpuBackend(shared, Policy("cuda_p2p")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Chosen(shared, Policy("cuda_p2p", "host_staged", true, true)), GpuBackend::kCudaP2p);
}

TEST(GpuBackendChoiceTest, ExplicitHostStagedAndNcclAreCheckedAgainstTheGroup) {
  GpuGroupProbe no_p2p = OneHost(2);
  no_p2p.can_access[0][1] = no_p2p.can_access[1][0] = false;
  EXPECT_EQ(Chosen(no_p2p, Policy("host_staged")), GpuBackend::kHostStaged);
  EXPECT_EQ(Chosen(OneHost(2), Policy("host_staged")), GpuBackend::kHostStaged);
  EXPECT_EQ(Chosen(Probe({"a", "a"}, {"x", "x"}), Policy("host_staged")), GpuBackend::kHostStaged);
  EXPECT_EQ(ChooseGpuBackend(Probe({"a", "b"}, {"x", "y"}), Policy("host_staged")).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(ChooseGpuBackend(OneHost(65), Policy("host_staged")).status().code(),
            absl::StatusCode::kUnimplemented);

  EXPECT_EQ(Chosen(OneHost(2), Policy("nccl")), GpuBackend::kNccl);
  EXPECT_EQ(Chosen(Probe({"a", "b"}, {"x", "x"}), Policy("nccl")), GpuBackend::kNccl);
  EXPECT_EQ(ChooseGpuBackend(OneHost(2), Policy("nccl", "host_staged", false)).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(ChooseGpuBackend(Probe({"a", "a"}, {"x", "x"}), Policy("nccl")).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(GpuBackendChoiceTest, RejectsUnknownNamesAndMalformedProbes) {
  EXPECT_EQ(ChooseGpuBackend(OneHost(2), Policy("shm")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChooseGpuBackend(OneHost(2), Policy("auto", "cuda_p2p")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChooseGpuBackend(GpuGroupProbe{}, Policy("auto")).status().code(),
            absl::StatusCode::kInvalidArgument);
  GpuGroupProbe p = OneHost(3);
  p.can_access[1].pop_back();
  EXPECT_EQ(ChooseGpuBackend(p, Policy("auto")).status().code(),
            absl::StatusCode::kInvalidArgument);
  p = OneHost(3);
  p.pci_bus_ids.pop_back();
  EXPECT_EQ(ChooseGpuBackend(p, Policy("auto")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DescribeGpuGroupProbe(p), "malformed probe");
}

TEST(GpuBackendChoiceTest, DescribesTheProbeForTheStartUpLog) {
  GpuGroupProbe p = OneHost(3);
  p.can_access[0][2] = false;
  EXPECT_EQ(DescribeGpuGroupProbe(p),
            "3 ranks on 1 host; GPUs 0000:00:00.0,0000:01:00.0,0000:02:00.0; peer access: 2 of "
            "3 pairs (missing: 0-2)");
}

TEST(GpuBackendChoiceTest, EveryRankOfAnOddGroupDecidesAlike) {
  // The probe is exchanged, so the choice is a function of it alone: check
  // that a randomly degraded 5-rank probe gives one answer however often asked.
  GpuGroupProbe p = OneHost(5);
  uint32_t state = 12345;
  for (int trial = 0; trial < 50; ++trial) {
    for (auto& row : p.can_access) {
      for (size_t j = 0; j < row.size(); ++j) {
        state = state * 1664525u + 1013904223u;
        row[j] = (state >> 28) != 0;  // ~1/16 missing
      }
    }
    const absl::StatusOr<GpuBackendChoice> a = ChooseGpuBackend(p, Policy("auto"));
    const absl::StatusOr<GpuBackendChoice> b = ChooseGpuBackend(p, Policy("auto"));
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->backend, b->backend);
    EXPECT_EQ(a->reason, b->reason);
    bool all = true;
    for (int i = 0; i < 5; ++i) {
      for (int j = i + 1; j < 5; ++j) all = all && p.can_access[i][j] && p.can_access[j][i];
    }
    EXPECT_EQ(a->backend, all ? GpuBackend::kCudaP2p : GpuBackend::kHostStaged) << trial;
  }
}

TEST(LocalCommDefaultsTest, FillsOnlyWhatTheGroupLeavesUnset) {
  LocalCommDefaults local;
  local.ucx_tls = "tcp";
  local.nccl.socket_ifname = "eth1";
  local.nccl.ib_hca = "mlx5_0:1";
  local.nccl.ib_gid_index = 3;
  local.nccl.net_name = "IB";
  local.nccl.enable_ib = false;
  local.nccl.extra_env = {{"NCCL_BUFFSIZE", "1048576"}, {"NCCL_NTHREADS", "256"}};

  CommSpec spec;
  spec.ucx_tls = "rc,tcp";
  spec.nccl.socket_ifname = "eth0";
  spec.nccl.extra_env = {{"NCCL_NTHREADS", "512"}};
  const CommSpec merged = MergeLocalCommDefaults(spec, local);
  EXPECT_EQ(merged.ucx_tls, "rc,tcp");
  EXPECT_EQ(merged.nccl.socket_ifname, "eth0");
  EXPECT_EQ(merged.nccl.ib_hca, "mlx5_0:1");
  EXPECT_EQ(merged.nccl.ib_gid_index, 3);
  EXPECT_EQ(merged.nccl.net_name, "IB");
  EXPECT_FALSE(merged.nccl.enable_ib);
  ASSERT_EQ(merged.nccl.extra_env.size(), 2u);
  EXPECT_EQ(merged.nccl.extra_env[0].second, "512");
  EXPECT_EQ(merged.nccl.extra_env[1].first, "NCCL_BUFFSIZE");

  const CommSpec empty = MergeLocalCommDefaults(CommSpec{}, LocalCommDefaults{});
  EXPECT_TRUE(empty.ucx_tls.empty());
  EXPECT_EQ(empty.nccl.ib_gid_index, -1);
  EXPECT_TRUE(empty.nccl.enable_ib);

  SetLocalCommDefaults(local);
  EXPECT_EQ(GetLocalCommDefaults().nccl.ib_hca, "mlx5_0:1");
  SetLocalCommDefaults(LocalCommDefaults{});
  EXPECT_TRUE(GetLocalCommDefaults().nccl.ib_hca.empty());
}

TEST(CommFactoryTest, CpuRanksRefuseGpuBackendsNamingTheAlternatives) {
  for (const char* backend : {"auto", "cuda_p2p", "host_staged", "nccl"}) {
    CommSpec spec;
    spec.backend = backend;
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        CreateCommunicator(spec, 0, 2, absl::Now() + absl::Seconds(1));
    EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument) << backend;
    EXPECT_THAT(comm.status().message(), HasSubstr("shm"));
  }
}

TEST(CommFactoryTest, GpuCommunicatorNeedsABootstrapAddress) {
  CommSpec spec;
  spec.backend = "auto";
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      CreateGpuCommunicator(spec, 0, 2, absl::Now() + absl::Seconds(1));
  EXPECT_FALSE(comm.ok());
#if defined(EXL3_HAVE_CUDA)
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(comm.status().message(), HasSubstr("bootstrap"));
#else
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnimplemented);
#endif
  spec.backend = "shm";
  spec.bootstrap_address = "127.0.0.1:1";
  comm = CreateGpuCommunicator(spec, 0, 2, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::worker::comm
