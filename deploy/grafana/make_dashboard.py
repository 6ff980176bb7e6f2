#!/usr/bin/env python3
"""Writes deploy/grafana/exl3serve.json, the Grafana dashboard of exl3serve.

Run it after changing a panel (python3 deploy/grafana/make_dashboard.py); the
JSON is committed. tests/cli/metrics_test.sh checks that every metric the
dashboard queries is exported by a running cluster.
"""
import json
import os

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'model_name=~"$model_name"'
RATE = "$__rate_interval"

panels = []


def panel(title, targets, unit, x, y, w=12, h=8, kind="timeseries", description=""):
    panels.append({
        "id": len(panels) + 1,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"datasource": DS, "refId": chr(ord("A") + i), "expr": e, "legendFormat": l}
                    for i, (e, l) in enumerate(targets)],
    })


def quantiles(metric, by=""):
    group = "le" + (", " + by if by else "")
    label = "".join("{{%s}} " % b.strip() for b in by.split(",") if b.strip())
    return [("histogram_quantile(%s, sum by (%s) (rate(%s_bucket{%s}[%s])))" % (q, group, metric, SEL, RATE),
             "%sp%s" % (label, int(q * 100))) for q in (0.5, 0.9, 0.99)]


panel("Time to first token", quantiles("exl3serve:time_to_first_token_seconds"), "s", 0, 0,
      description="From arrival (after tokenization) to the first sampled token.")
panel("Inter-token latency", quantiles("exl3serve:inter_token_latency_seconds"), "s", 12, 0)
panel("End-to-end request latency", quantiles("exl3serve:e2e_request_latency_seconds"), "s", 0, 8)
panel("Queue time", quantiles("exl3serve:request_queue_time_seconds"), "s", 12, 8)
panel("Token throughput", [
    ("sum(rate(exl3serve:prompt_tokens_total{%s}[%s]))" % (SEL, RATE), "prompt tokens/s"),
    ("sum(rate(exl3serve:generation_tokens_total{%s}[%s]))" % (SEL, RATE), "generation tokens/s"),
], "short", 0, 16)
panel("Finished requests", [
    ("sum by (finished_reason) (rate(exl3serve:request_success_total{%s}[%s]))" % (SEL, RATE),
     "{{finished_reason}}"),
    ("sum by (reason) (rate(exl3serve:request_failure_total{%s}[%s]))" % (SEL, RATE), "error {{reason}}"),
], "reqps", 12, 16)
panel("Scheduler state", [
    ("sum(exl3serve:num_requests_running{%s})" % SEL, "running"),
    ("sum(exl3serve:num_requests_waiting{%s})" % SEL, "waiting"),
    ("sum(rate(exl3serve:num_preemptions_total{%s}[%s]))" % (SEL, RATE), "preemptions/s"),
], "short", 0, 24)
panel("KV cache usage", [("max(exl3serve:kv_cache_usage_perc{%s})" % SEL, "usage")],
      "percentunit", 12, 24)
panel("Rank forward time p90 (per rank, phase)",
      [quantiles("exl3serve:rank_forward_seconds", "rank, phase")[1]], "s", 0, 32,
      description="One forward on each rank: its share of a step, collectives included.")
panel("Coordinator step", [
    quantiles("exl3serve:engine_step_seconds")[1],
    ("sum(rate(exl3serve:engine_step_coordinator_seconds_total{%s}[%s])) / "
     "sum(rate(exl3serve:engine_step_seconds_sum{%s}[%s]))" % (SEL, RATE, SEL, RATE),
     "coordinator share"),
], "s", 12, 32, description="Step wall time, and the part spent in the coordinator, not the ranks.")
panel("Collective latency p99 (backend, op, size class)",
      [quantiles("exl3serve:collective_latency_seconds", "backend, op, size_class")[2]], "s", 0, 40)
panel("Collective throughput per rank", [
    ("sum by (rank, backend) (rate(exl3serve:collective_bytes_total{%s}[%s]))" % (SEL, RATE),
     "rank {{rank}} {{backend}}"),
], "Bps", 12, 40)
panel("Ranks up", [("exl3serve:rank_up{%s}" % SEL, "rank {{rank}}")], "short", 0, 48, w=8)
panel("Collective timeouts and failures", [
    ("sum by (rank) (increase(exl3serve:collective_timeouts_total{%s}[5m]))" % SEL, "timeouts rank {{rank}}"),
    ("sum by (rank) (increase(exl3serve:collective_failures_total{%s}[5m]))" % SEL, "failures rank {{rank}}"),
], "short", 8, 48, w=8)
panel("Rank restarts and request replays", [
    ("sum(increase(exl3serve:rank_restarts_total{%s}[5m]))" % SEL, "group re-formations"),
    ("sum(increase(exl3serve:request_replays_total{%s}[5m]))" % SEL, "replayed requests"),
], "short", 16, 48, w=8)

panel("Spill store: row lookups and cache hit ratio (per rank, tensor)", [
    ("sum by (rank, tensor) (rate(exl3serve:spill_lookups_total{%s}[%s]))" % (SEL, RATE),
     "lookups/s rank {{rank}} {{tensor}}"),
    ("sum by (rank, tensor) (rate(exl3serve:spill_cache_hits_total{%s}[%s])) / "
     "sum by (rank, tensor) (rate(exl3serve:spill_lookups_total{%s}[%s]))" % (SEL, RATE, SEL, RATE),
     "hit ratio rank {{rank}} {{tensor}}"),
], "short", 0, 56, w=8,
      description="Rows of spilled row tables (token embedding) looked up, and the share served "
                  "from the bounded row cache.")
panel("Spill store: disk reads and bytes", [
    ("sum by (rank, tensor) (rate(exl3serve:spill_reads_total{%s}[%s]))" % (SEL, RATE),
     "reads/s rank {{rank}} {{tensor}}"),
    ("sum by (rank, tensor) (rate(exl3serve:spill_read_bytes_total{%s}[%s]))" % (SEL, RATE),
     "bytes/s rank {{rank}} {{tensor}}"),
], "short", 8, 56, w=8)
panel("Spill store read latency", quantiles("exl3serve:spill_read_latency_seconds", "tensor"), "s",
      16, 56, w=8, description="One coalesced pread of a spilled table plus its checksum check.")
panel("Expert load (tokens/s per rank and expert)", [
    ("sum by (rank, expert) (rate(exl3serve:expert_tokens_total{%s}[%s]))" % (SEL, RATE),
     "rank {{rank}} expert {{expert}}"),
], "short", 0, 64, w=24,
      description="MoE: tokens routed to each expert a rank holds, summed over layers.")

panel("Prefix cache: hit rate (tokens)", [
    ("sum(rate(exl3serve:prefix_cache_hits_total{%s}[%s])) / "
     "sum(rate(exl3serve:prefix_cache_queries_total{%s}[%s]))" % (SEL, RATE, SEL, RATE), "hit rate"),
], "percentunit", 0, 72, w=8,
      description="Prompt tokens found in the prefix cache (RAM or disk tier) over prompt tokens "
                  "looked up at admission (vLLM's prefix_cache_hits / prefix_cache_queries).")
panel("Prefix cache: blocks", [
    ("sum(exl3serve:prefix_cache_blocks{%s})" % SEL, "cached in RAM"),
    ("sum(exl3serve:prefix_cache_disk_used_blocks{%s})" % SEL, "on disk"),
    ("sum(rate(exl3serve:prefix_cache_evicted_blocks_total{%s}[%s]))" % (SEL, RATE), "evicted/s"),
    ("sum(rate(exl3serve:prefix_cache_disk_saved_blocks_total{%s}[%s]))" % (SEL, RATE), "saved to disk/s"),
    ("sum(rate(exl3serve:prefix_cache_disk_hit_blocks_total{%s}[%s]))" % (SEL, RATE), "disk hits/s"),
    ("sum(rate(exl3serve:prefix_cache_disk_miss_blocks_total{%s}[%s]))" % (SEL, RATE), "disk misses/s"),
    ("sum(rate(exl3serve:prefix_cache_disk_evicted_blocks_total{%s}[%s]))" % (SEL, RATE), "disk evictions/s"),
], "short", 8, 72, w=8,
      description="The coordinator's block pool: blocks holding a known prefix, and the disk tier's slots.")
panel("KV disk tier per rank: bytes and failures", [
    ("sum by (rank) (rate(exl3serve:kv_disk_written_bytes_total{%s}[%s]))" % (SEL, RATE),
     "written B/s rank {{rank}}"),
    ("sum by (rank) (rate(exl3serve:kv_disk_read_bytes_total{%s}[%s]))" % (SEL, RATE),
     "read B/s rank {{rank}}"),
    ("sum by (rank) (increase(exl3serve:kv_disk_checksum_failures_total{%s}[5m]))" % SEL,
     "checksum failures rank {{rank}}"),
    ("sum by (rank) (increase(exl3serve:kv_disk_misses_total{%s}[5m]))" % SEL, "misses rank {{rank}}"),
    ("sum by (rank) (increase(exl3serve:kv_disk_dropped_saves_total{%s}[5m]))" % SEL,
     "dropped saves rank {{rank}}"),
    ("sum by (rank) (increase(exl3serve:kv_disk_io_errors_total{%s}[5m]))" % SEL, "I/O errors rank {{rank}}"),
], "short", 16, 72, w=8,
      description="Each rank's file of evicted KV blocks: bytes written and read back, and blocks that "
                  "came back as misses (corrupt, dropped or failed I/O: recomputed, never used).")

panel("Speculative decoding: acceptance", [
    ("sum(rate(exl3serve:spec_decode_num_accepted_tokens_total{%s}[%s])) / "
     "sum(rate(exl3serve:spec_decode_num_draft_tokens_total{%s}[%s]))" % (SEL, RATE, SEL, RATE),
     "acceptance rate"),
], "percentunit", 0, 80, w=8,
      description="Draft tokens the ranks accepted (equal to their own draw) over draft tokens verified.")
panel("Speculative decoding: mean accepted length", [
    ("1 + sum(rate(exl3serve:spec_decode_num_accepted_tokens_total{%s}[%s])) / "
     "sum(rate(exl3serve:spec_decode_num_drafts_total{%s}[%s]))" % (SEL, RATE, SEL, RATE),
     "tokens per drafting step"),
], "short", 8, 80, w=8,
      description="Tokens a drafting sequence gains per step: 1 + accepted drafts (vLLM's mean acceptance "
                  "length).")
panel("Speculative decoding: draft and accepted tokens/s", [
    ("sum(rate(exl3serve:spec_decode_num_draft_tokens_total{%s}[%s]))" % (SEL, RATE), "drafted/s"),
    ("sum(rate(exl3serve:spec_decode_num_accepted_tokens_total{%s}[%s]))" % (SEL, RATE), "accepted/s"),
    ("sum(rate(exl3serve:spec_decode_num_drafts_total{%s}[%s]))" % (SEL, RATE), "drafts/s"),
], "short", 16, 80, w=8,
      description="serve --speculative ngram: drafts verified per second, their tokens, and those accepted.")

panel("Structured output: mask time per row", [
    ("sum(rate(exl3serve:structured_output_mask_seconds_total{%s}[%s])) / "
     "sum(rate(exl3serve:structured_output_masks_total{%s}[%s]))" % (SEL, RATE, SEL, RATE),
     "seconds per mask row"),
], "s", 0, 88, w=12,
      description="Coordinator time to compute one constrained draw's allowed-token mask (JSON schema, "
                  "regex, choice or grammar requests).")
panel("Structured output: share of step time", [
    ("sum(rate(exl3serve:structured_output_mask_seconds_total{%s}[%s])) / "
     "sum(rate(exl3serve:engine_step_seconds_sum{%s}[%s]))" % (SEL, RATE, SEL, RATE),
     "mask time / step time"),
], "percentunit", 12, 88, w=12,
      description="The scheduler thread computes masks before each step; this is their share of the "
                  "engine's step time.")
panel("Recurrent state (Gated DeltaNet hybrids)", [
    ("max(exl3serve:recurrent_state_bytes_per_sequence{%s}) * max(exl3serve:recurrent_state_sequences{%s})"
     % (SEL, SEL), "bytes held over the ranks"),
    ("max(exl3serve:recurrent_state_bytes_per_sequence{%s})" % SEL, "bytes per sequence"),
], "bytes", 0, 96, w=12,
      description="Models with a recurrent state per sequence (Qwen3-Next, Qwen3.5): every running "
                  "sequence holds one on the ranks besides its KV pages; serve --max-state-sequences "
                  "caps how many. Zero for KV-only models.")
panel("State snapshots (prefix cache of hybrids)", [
    ("max(exl3serve:state_snapshots{%s})" % SEL, "snapshots held"),
    ("sum(rate(exl3serve:state_snapshot_saves_total{%s}[%s]))" % (SEL, RATE), "taken / s"),
    ("sum(rate(exl3serve:state_snapshot_hits_total{%s}[%s]))" % (SEL, RATE), "resumed / s"),
], "short", 12, 96, w=12,
      description="The prefix cache of a model with a recurrent state keeps snapshots of the state "
                  "at block boundaries (each prompt's last full block, every "
                  "--state-snapshot-interval blocks; at most --state-snapshots); an admission "
                  "resumes from the deepest one whose blocks are cached.")

dashboard = {
    "title": "exl3serve",
    "uid": "exl3serve",
    "tags": ["exl3serve", "llm"],
    "timezone": "browser",
    "schemaVersion": 39,
    "version": 1,
    "refresh": "10s",
    "time": {"from": "now-1h", "to": "now"},
    "templating": {"list": [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
        {"name": "model_name", "type": "query", "datasource": DS, "label": "Model",
         "query": {"query": "label_values(exl3serve:num_requests_running, model_name)", "refId": "model"},
         "definition": "label_values(exl3serve:num_requests_running, model_name)",
         "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}, "refresh": 2},
    ]},
    "panels": panels,
}

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exl3serve.json")
with open(out, "w") as f:
    json.dump(dashboard, f, indent=2)
    f.write("\n")
print("wrote", out)
