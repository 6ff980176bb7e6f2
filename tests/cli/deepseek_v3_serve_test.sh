#!/usr/bin/env bash
# DeepSeek-V3 / Kimi K2 (DeepseekV3ForCausalLM, multi-head latent
# attention) served end to end through the gRPC API (issue 19): MLA with
# q_lora_rank, YaRN, the paged latent cache (prompts of 17+ tokens take the
# prefill path, decode steps and verify steps the absorbed form), a dense
# first layer, grouped sigmoid routing (8 experts in 4 groups, 2 groups kept,
# 3 experts per token), a shared expert and an MTP layer that is skipped. At
# TP 2 the 5 query heads split 3/2 and every rank keeps its own latent cache:
#   * the DeepSeek demo model (`make-demo-model --arch deepseek-v3`: peaked logits, the
#     Qwen3 tokenizer when built into $EXL3_BUILD_DIR/demo-tokenizer), converted
#     to EXL3 (3 bpw): `serve --tp 2 --ep 2` (query heads over 2 ranks, the
#     latent on both, the routed experts 4/4) gives every stream's greedy ids of `serve --tp 1`, each
#     stream alone and all 16 at once, and the same text for a prompt;
#   * the DeepSeek test model (random logits, so seeded sampling really samples;
#     unquantized, as seeded_sampling_test.sh: at 3 bpw its greedy margins are
#     small enough that a batch flips a token even at TP 1): greedy and seeded
#     sampling with penalties at TP 2 x EP 2 equal TP 1, alone and batched.
#     Logits differ in the last bits between TP sizes (all-reduce order), so a
#     seeded draw could in principle differ at an interval edge:
#     seeded_sampling_test.sh puts the odds at ~1e-3 for this many draws;
#   * with n-gram drafts (`--speculative ngram`) at TP 2 x EP 2 every stream
#     of the test model equals its undrafted reference on the same
#     configuration, alone and batched, greedy and seeded, and drafts were
#     verified and accepted (the demo model's output never repeats within a
#     stream, so no n-gram draft would apply to it).
# Needs /usr/bin/python3 with grpcio and the stubs in $EXL3_BUILD_DIR/python
# (else exit 77 = skip).
ARCH=deepseek-v3
source "${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}/tests/cli/lib/moe_serve.sh"
