#!/usr/bin/env bash
# Installs the Debian packages exl3serve builds and tests with. Idempotent: asks
# apt only for what is missing. Needs root (or sudo) on Debian 12.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
APT=(apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3)
PKGS=(build-essential cmake ninja-build pkg-config
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
      libucx-dev ucx-utils nlohmann-json3-dev libgtest-dev libgmock-dev libbenchmark-dev
      libssl-dev curl   # TLS of the OpenAI HTTP API (coordinator/http/, OpenSSL) and its curl tests
      libyaml-cpp-dev libcli11-dev libicu-dev python3-numpy python3-jinja2 prometheus prometheus-cpp-dev iproute2 openssl
      python3-grpcio python3-protobuf   # the Python gRPC client of tests/cli/serve_e2e_test.sh (/usr/bin/python3)
      clang libclang-rt-14-dev
      libopenblas-dev   # optional: the dense baseline of tests/bench/trellis_gemv_bench
      yamllint   # tests/cli/deploy_manifests_test.sh
      libopenmpi-dev openmpi-bin)  # optional: the MPI baseline of tests/bench/allreduce_bench
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "install-deps: installing ${missing[*]}"
  $SUDO "${APT[@]}" update -qq
  $SUDO "${APT[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# PyTorch (Debian's python3-torch, CPU) runs an independent reference forward
# in tests/cli/torch_reference_test.sh. Optional: a failed install only makes
# that test skip.
if ! dpkg-query -W -f='${Status}' python3-torch 2>/dev/null | grep -q 'ok installed'; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO "${APT[@]}" install -y -qq --no-install-recommends python3-torch >/dev/null 2>&1 ||
    echo "install-deps: python3-torch not installed; the PyTorch reference test will skip"
fi
# Node.js + npm run the reference tokenizer (Hugging Face's tokenizers) in the
# tests; the image usually ships them, Debian's packages otherwise.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO "${APT[@]}" update -qq
  $SUDO "${APT[@]}" install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
