"""netbench's records from the hosts' results: per method and link setting, the slowest host's
step, the bits on the wire against the compiled program's, tables, checks and the plot."""

import math
import statistics

from loco_jax.apps import netbench_profile, netns, sent

BITS_TOLERANCE = 0.02         # the payload within 2% of the compiled program's prediction
# Under this many bytes a host a step, gloo's own messages (about 570 bytes a step at 2 hosts,
# 3.5% of a 4,096-parameter fp32 all-reduce) are over 1% of the payload: it is not checked.
MIN_CHECKED_BYTES = 64 * 1024


def summarize(results: list[dict], hosts: int, rate: str, n_params: int, nodes: int = 1,
              inter_rate: str | None = None, calibration=None) -> list[dict]:
  """One record per method: the slowest host's median step, the mean bits the hosts sent (on
  the interface, and the TCP payload among them) and, on two levels, the bits every node sent
  the others (read by host 0 on the uplinks). With a `calibration` (one level), the step
  `step_model` predicts from the compiled collectives, as `predicted_step_s`."""
  records = []
  results = [r for r in results if r.get("kind", "result") == "result"]
  for method in dict.fromkeys(r["method"] for r in results):
    rows = [r for r in results if r["method"] == method]
    if len(rows) != hosts:
      raise RuntimeError(f"{method}: {len(rows)} of {hosts} hosts reported")
    predicted = rows[0]["predicted_bits_per_param"]
    record = {
        "method": method, "hosts": hosts, "rate": rate, "n_params": n_params,
        "step_s": max(r["step_s"] for r in rows),
        "cpu_s": max(r["cpu_s"] for r in rows),
        "collectives_s": max(r["collectives_s"] for r in rows),
        # The step's host work outside its collectives (the busiest host's), a step.
        "host_work_s": max(r["cpu_s"] - r["collectives_cpu_s"] for r in rows),
        "measured_bits_per_param": statistics.mean(r["measured_bits_per_param"] for r in rows),
        "measured_bits_per_host": [r["measured_bits_per_param"] for r in rows],
        **_payload(rows),
        "predicted_bits_per_param": predicted,
        "predicted_step_s": None if calibration is None else predicted_step(
            calibration, method, rows[0]["collectives"], n_params),
        "finite": all(r["finite"] for r in rows),
        "host_malloc": rows[0]["malloc"],
        "host_cpus": [r["cpus"] for r in rows],
        "exchange": rows[0]["exchange"],
        # The state's step counts (the same on every host where they are replicated), and
        # its gauges: every device's value after the last timed step, and their mean.
        "counts": {k: max(r["counts"][k] for r in rows) for k in rows[0]["counts"]},
        "gauges": {k: statistics.mean(v for r in rows for v in r["gauges"][k])
                   for k in rows[0]["gauges"]},
        "gauges_per_device": {k: [v for r in rows for v in r["gauges"][k]]
                              for k in rows[0]["gauges"]},
        "steps": rows[0]["steps"],
        "conditional_steps": max(r["conditional_steps"] for r in rows),
        "conditional_bits_per_param": rows[0]["conditional_bits_per_param"],
        "extension_steps": max(r["extension_steps"] for r in rows),
        "extension_bits_per_param": rows[0]["extension_bits_per_param"],
        "collectives": rows[0]["collectives"]}
    record["expected_bits_per_param"] = expected_bits(record)
    if rows[0].get("profile"):   # netbench_profile: seconds a step of each kind, per host
      record["profile_per_host"] = [r["profile"] for r in rows]
      record["profile"] = {k: statistics.mean(r["profile"][k] for r in rows)
                           for k in ("wall_s", *netbench_profile.KINDS)}
    if nodes > 1:
      record.update(_inter_node(rows[0], nodes, inter_rate))
    records.append(record)
  return records


def _payload(rows: list[dict]) -> dict:
  """The hosts' TCP payload (bits a parameter, and its mean) and their raw counts."""
  return {"payload_bits_per_param": statistics.mean(r["payload_bits_per_param"] for r in rows),
          "payload_bits_per_host": [r["payload_bits_per_param"] for r in rows],
          "sent_per_host": [r["sent"] for r in rows]}


def predicted_step(calibration, method: str, collectives: list[str], n_params: int) -> float:
  """`step_model.predict`'s step of a flat method from its record's collectives
  ('op:dtype:bytes:data[:cond]', every device in each group)."""
  from loco_jax import comm
  from loco_jax.apps import step_model
  found = []
  for text in collectives:
    op, dtype, nbytes, *rest = text.split(":")
    found.append(comm.Collective(op, dtype, float(nbytes), calibration.devices,
                                 conditional="cond" in rest))
  return step_model.predict(calibration, method, found, n_params).step_s


def _inter_node(host0: dict, nodes: int, inter_rate: str) -> dict:
  """The two-level fields: bits per parameter per step every node sent the others, measured
  on its uplink and predicted from the compiled collectives (None: no model for one of them)."""
  measured = host0["measured_inter_bits_per_node"]
  predicted = host0["predicted_inter_bits_per_node"]
  if measured is None or len(measured) != nodes:
    raise RuntimeError(f"{host0['method']}: host 0 did not report the {nodes} uplinks' counters")
  return {
      "nodes": nodes, "inter_rate": inter_rate, "topology": host0["topology"],
      "measured_inter_bits_per_param": sum(measured), "measured_inter_bits_per_node": measured,
      "predicted_inter_bits_per_param": None if predicted is None else sum(predicted),
      "predicted_inter_bits_per_node": predicted}


def summarize_training(results: list[dict], hosts: int, rate: str) -> list[dict]:
  """One record per training method: the slowest host's median step, tokens per second, eval
  loss, its split into compute (the same step with no exchange, method "compute") and exchange
  (of which `collectives_s`: the step's collectives alone, replayed as compiled)."""
  rows = [r for r in results if r.get("kind") == "train"]
  compute = [r for r in rows if r["method"] == "compute"]
  if len(compute) != hosts:
    raise RuntimeError(f"training: {len(compute)} of {hosts} hosts reported the compute step")
  compute_s = max(r["step_s"] for r in compute)
  records = []
  for method in dict.fromkeys(r["method"] for r in rows):
    mine = [r for r in rows if r["method"] == method]
    if len(mine) != hosts:
      raise RuntimeError(f"training {method}: {len(mine)} of {hosts} hosts reported")
    first, step_s = mine[0], max(r["step_s"] for r in mine)
    n = first["n_params"]
    record = {
        "method": method, "kind": "train", "hosts": hosts, "rate": rate, "n_params": n,
        "step_s": step_s, "tokens_per_s": first["tokens_per_step"] / step_s,
        "tokens_vs_compute": compute_s / step_s,
        "eval_loss": statistics.mean(r["eval_loss"] for r in mine),
        "final_loss": statistics.mean(r["final_loss"] for r in mine),
        "compute_s": compute_s, "exchange_s": max(step_s - compute_s, 0.0),
        "collectives_s": max(r["collectives_s"] for r in mine),
        "measured_bits_per_param": statistics.mean(r["measured_bits_per_param"] for r in mine),
        "measured_bits_per_host": [r["measured_bits_per_param"] for r in mine],
        **_payload(mine),
        "predicted_bits_per_param": first["predicted_bits_per_param"],
        "overlapped_collectives": first.get("overlapped_collectives", 0)}
    if "inner_s" in first:   # DiLoCo: its steps by kind, the slowest host's
      record.update({k: first[k] for k in ("inner_steps", "fragments", "overlap")})
      record.update({k: None if first[k] is None else max(r[k] for r in mine)
                     for k in ("inner_s", "sync_step_s", "merge_step_s")})
    records.append(record)
  return records


def table_head(*columns: str) -> list[str]:
  """A Markdown table's header and rule."""
  return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def format_training_table(records: list[dict]) -> list[str]:
  lines = table_head("method", "hosts", "rate", "params", "step ms", "compute ms",
                     "exchange ms (share)", "collectives ms", "tokens/s (vs compute)",
                     "eval loss", "bits/param sent, payload (pred.)", "overlapped")
  for r in records:
    lines.append(
        f"| {r['method']} | {r['hosts']} | {r['rate']} | {r['n_params']} | "
        f"{r['step_s'] * 1e3:.1f} | {r['compute_s'] * 1e3:.1f} | {r['exchange_s'] * 1e3:.1f} "
        f"({r['exchange_s'] / r['step_s']:.0%}) | {r['collectives_s'] * 1e3:.1f} | "
        f"{r['tokens_per_s']:.0f} ({r['tokens_vs_compute']:.2f}x) | "
        f"{r['eval_loss']:.4f} | "
        f"{r['measured_bits_per_param']:.2f}, {r['payload_bits_per_param']:.2f} "
        f"({r['predicted_bits_per_param']:.2f}) | {r['overlapped_collectives']} |")
  return lines


def format_diloco_table(records: list[dict]) -> list[str]:
  """The DiLoCo methods' steps by kind: the inner step alone, the step that starts a sync
  (without overlap the whole sync), the one that merges it (with overlap: the sync's rest)."""
  lines = table_head("method", "H", "F", "overlap", "inner step ms", "sync step ms",
                     "merge step ms", "mean step ms", "tokens/s vs compute")
  ms = lambda s: "-" if s is None else f"{s * 1e3:.1f}"
  for r in records:
    if "inner_s" in r:
      lines.append(f"| {r['method']} | {r['inner_steps']} | {r['fragments']} | {r['overlap']} | "
                   f"{ms(r['inner_s'])} | {ms(r['sync_step_s'])} | {ms(r['merge_step_s'])} | "
                   f"{ms(r['step_s'])} | {r['tokens_vs_compute']:.2f}x |")
  return lines if len(lines) > 2 else []


def expected_bits(record: dict) -> float:
  """Bits a parameter per step the compiled program sends over the timed steps: every step's
  collectives, plus the conditional ones on the steps that ran them (CO3's raw resend, which
  follows its slots' extensions; the extensions alone on the other steps that took them, all
  of them where a step may have taken one: at most)."""
  steps, resent = record.get("steps", 1), record.get("conditional_steps", 0)
  extended_only = max(record.get("extension_steps", 0) - resent, 0)
  return (record["predicted_bits_per_param"]
          + resent / steps * record.get("conditional_bits_per_param", 0)
          + extended_only / steps * record.get("extension_bits_per_param", 0))


def _off(measured: list[float], predicted: float) -> float:
  return max(abs(b / predicted - 1) for b in measured)


def _unexplained(record: dict, where: str) -> list[str]:
  """A failure per host whose interface sent more (or less) than its TCP payload, headers and
  retransmissions explain."""
  return [f"{where}: host {k}: {why}" for k, counts in enumerate(record["sent_per_host"])
          if (why := sent.Sent(**counts).unexplained())]


def payload_checked(record: dict) -> bool:
  """Whether a host's payload is large enough a step (`MIN_CHECKED_BYTES`) to be held to the
  compiled program's bytes."""
  return expected_bits(record) * record["n_params"] / 8 >= MIN_CHECKED_BYTES


def check(records: list[dict], min_rate_fraction: float) -> list[str]:
  """The failures: a host's payload off the prediction by more than 2% (`payload_checked`), or
  its interface's bytes not explained by the payload, headers and retransmissions; on two
  levels a node's bits to the others off by more than 2%; a NaN output; the shaper's
  calibration: one plain TCP stream between two hosts (across nodes on two levels) carrying
  under `min_rate_fraction` of the nominal rate, or over all of it (no shaping)."""
  failures = []
  for r in records:
    where = f"{r['method']} at {link_setting(r)}"
    expected = expected_bits(r)
    worst = _off(r["payload_bits_per_host"], expected)
    if worst > BITS_TOLERANCE and payload_checked(r):
      failures.append(f"{where}: a host's payload was {worst:.1%} off the predicted "
                      f"{expected:.2f} bits/param{_conditional_note(r)}")
    failures += _unexplained(r, where)
    for k, (got, want) in enumerate(zip(r.get("measured_inter_bits_per_node") or [],
                                        r.get("predicted_inter_bits_per_node") or [])):
      if want > 0 and abs(got / want - 1) > BITS_TOLERANCE:
        failures.append(f"{where}: node {k} sent the other nodes {got:.2f} bits/param, "
                        f"{got / want - 1:+.1%} off the predicted {want:.2f}")
    if not r["finite"]:
      failures.append(f"{where}: non-finite output")
  for setting, (share, _) in calibrations(records).items():
    if not min_rate_fraction <= share <= 1:
      failures.append(f"calibration at {setting}: one TCP stream between two hosts carried "
                      f"{share:.1%} of the nominal rate (a shaped link carries "
                      f"{min_rate_fraction:.0%} to 100%)")
  return failures


def calibrations(records: list[dict]) -> dict[str, tuple[float, float | None]]:
  """{link setting: (the share of the nominal rate one TCP stream carried there, the fp32
  all-reduce's share (`rate_fraction`) or None where fp32 did not run)}."""
  found = {}
  for r in records:
    if "link_tcp_bits_per_s" in r:
      share, fp32 = found.get(link_setting(r), (r["link_tcp_bits_per_s"] / nominal_rate(r), None))
      found[link_setting(r)] = share, rate_fraction(r) if r["method"] == "fp32" else fp32
  return found


def check_training(records: list[dict]) -> list[str]:
  """Training failures: a host's payload off the compiled program's by more than 2% or its
  interface's bytes unexplained (the compute step sends almost nothing and is left out), a
  non-finite eval loss."""
  failures = []
  for r in records:
    if r["method"] != "compute":
      where = f"training {r['method']} at {r['rate']}"
      worst = _off(r["payload_bits_per_host"], r["predicted_bits_per_param"])
      if worst > BITS_TOLERANCE:
        failures.append(f"{where}: a host's payload was {worst:.1%} off the predicted "
                        f"{r['predicted_bits_per_param']:.2f} bits/param")
      failures += _unexplained(r, where)
    if not math.isfinite(r["eval_loss"]):
      failures.append(f"training {r['method']} at {r['rate']}: eval loss {r['eval_loss']}")
  return failures


def _conditional_note(record: dict) -> str:
  ran = max(record.get("conditional_steps", 0), record.get("extension_steps", 0))
  if not ran:
    return ""
  return (f" (of which {expected_bits(record) - record['predicted_bits_per_param']:.2f} from "
          f"the conditional collectives, run on {ran} of {record['steps']} timed steps)")


def link_setting(record: dict) -> str:
  """'1gbit', or on two levels '10gbit in / 1gbit between nodes'."""
  if record.get("nodes", 1) > 1:
    return f"{record['rate']} in / {record['inter_rate']} between nodes"
  return record["rate"]


def rate_fraction(record: dict) -> float:
  """The share of the nominal rate a method's step achieved: bits sent / step time / rate,
  of the busiest host's link, or on two levels of the busiest inter-node link."""
  bits = max(record["measured_inter_bits_per_node"] if record.get("nodes", 1) > 1
             else record["measured_bits_per_host"])
  return bits * record["n_params"] / record["step_s"] / nominal_rate(record)


def nominal_rate(record: dict) -> float:
  """Bits a second of the link the record's rate is about: the inter-node link on two levels."""
  return netns.rate_bits(record["inter_rate"] if record.get("nodes", 1) > 1 else record["rate"])


def format_table(records: list[dict]) -> list[str]:
  lines = table_head("method", "hosts", "rate", "params", "step ms", "cpu ms",
                     "host work ns/param", "collectives ms", "model ms (off)", "% of rate",
                     "bits/param sent", "payload", "predicted", "diff")
  for r in records:
    expected = expected_bits(r)
    diff = r["payload_bits_per_param"] / expected - 1
    lines.append(
        f"| {r['method']} | {r['hosts']} | {r['rate']} | {r['n_params']} | "
        f"{r['step_s'] * 1e3:.1f} | {r['cpu_s'] * 1e3:.1f} | "
        f"{r['host_work_s'] * 1e9 / r['n_params']:.1f} | {r['collectives_s'] * 1e3:.1f} | "
        f"{_model_cell(r)} | {rate_fraction(r):.0%} | {r['measured_bits_per_param']:.3f} | "
        f"{r['payload_bits_per_param']:.3f} | {expected:.3f} | {diff:+.2%}"
        f"{'' if payload_checked(r) else ' (not checked)'} |")
  return lines


def _model_cell(record: dict) -> str:
  """The model's step and how far the measured one is off it, or '-' without a calibration."""
  predicted = record.get("predicted_step_s")
  if predicted is None:
    return "-"
  return f"{predicted * 1e3:.1f} ({record['step_s'] / predicted - 1:+.0%})"


def format_state_table(records: list[dict]) -> list[str]:
  """The methods whose state netbench reads (`Method.counts`, `gauges`): which collectives
  ran, each count over the timed steps, each gauge's mean over the devices, and the bits of
  the conditional collectives a step that ran them added."""
  records = [r for r in records if r.get("counts") or r.get("gauges")]
  if not records:
    return []
  counts = list(dict.fromkeys(k for r in records for k in r["counts"]))
  gauges = list(dict.fromkeys(k for r in records for k in r["gauges"]))
  lines = table_head("method", "hosts", "rate", "exchange (collectives)",
                     *[f"{k} (steps)" for k in counts], *gauges, "conditional bits/param a step")
  for r in records:
    cells = [f"{r['counts'][k]} of {r['steps']}" if k in r["counts"] else "-" for k in counts]
    cells += [f"{r['gauges'][k]:.3f}" if k in r["gauges"] else "-" for k in gauges]
    lines.append(f"| {r['method']} | {r['hosts']} | {link_setting(r)} | {r['exchange']} | "
                 + " | ".join(cells) + f" | {r['conditional_bits_per_param']:.3f} |")
  return lines


def format_profile_table(records: list[dict]) -> list[str]:
  """The traced steps (netbench --profile): their wall time and their thunks' by kind."""
  lines = table_head("method", "hosts", "rate", "step ms (timed)", "traced step ms",
                     "collectives ms", "host callbacks ms", "compute ms")
  profiled = [r for r in records if r.get("profile")]
  for r in profiled:
    p = {k: f"{v * 1e3:.1f}" for k, v in r["profile"].items()}
    lines.append(f"| {r['method']} | {r['hosts']} | {link_setting(r)} | {r['step_s'] * 1e3:.1f} "
                 f"| {p['wall_s']} | {p['collectives']} | {p['host_callbacks']} | "
                 f"{p['compute']} |")
  for r in profiled:
    lines += ["", f"{r['method']}, {r['hosts']} hosts, {link_setting(r)}: host 0's costliest "
              "instructions", *table_head("instruction", "kind", "made at", "ms a step")]
    lines += [f"| {t['name']} | {t['kind']} | {t['source']} | {t['seconds'] * 1e3:.2f} |"
              for t in r["profile_per_host"][0]["top"]]
  return lines


def format_two_level_table(records: list[dict]) -> list[str]:
  """Two levels: per method the step, the bits each host sent, the bits that crossed between
  nodes (all nodes together, per parameter and step) and their share of flat LoCo's."""
  loco = {link_setting(r): r["measured_inter_bits_per_param"] for r in records
          if r["method"] == "loco"}
  lines = table_head("method", "nodes x hosts", "links", "step ms", "cpu ms", "collectives ms",
                     "bits/param a host sent (pred.)",
                     "inter-node bits/param (pred.)", "vs loco")
  for r in records:
    pred = r["predicted_inter_bits_per_param"]
    ratio = (f"{r['measured_inter_bits_per_param'] / loco[link_setting(r)]:.3f}x"
             if loco.get(link_setting(r)) else "-")
    lines.append(
        f"| {r['method']} | {r['nodes']} x {r['hosts'] // r['nodes']} | {link_setting(r)} | "
        f"{r['step_s'] * 1e3:.1f} | {r['cpu_s'] * 1e3:.1f} | {r['collectives_s'] * 1e3:.1f} | "
        f"{r['measured_bits_per_param']:.3f} "
        f"({r['predicted_bits_per_param']:.3f}) | {r['measured_inter_bits_per_param']:.3f} "
        f"({'-' if pred is None else f'{pred:.3f}'}) | {ratio} |")
  return lines


def plot(records: list[dict], path: str) -> None:
  """Step time against link rate (the inter-node rate on two levels) per method, measured
  (solid) and, where a calibration predicted it, `step_model`'s step (dashed), written whole
  or not at all."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from loco_jax.train import files
  link = lambda r: netns.rate_bits(r.get("inter_rate") or r["rate"])
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for i, method in enumerate(dict.fromkeys(r["method"] for r in records)):
    rows = sorted((r for r in records if r["method"] == method), key=link)
    x = [link(r) / 1e6 for r in rows]
    ax.plot(x, [r["step_s"] * 1e3 for r in rows], "o-", color=f"C{i}", label=method)
    predicted = [(x_i, r["predicted_step_s"] * 1e3) for x_i, r in zip(x, rows)
                 if r.get("predicted_step_s") is not None]
    if predicted:
      ax.plot(*zip(*predicted), "x--", color=f"C{i}", alpha=0.6)
  first = records[0]
  where = (f"{first['nodes']} nodes x {first['hosts'] // first['nodes']} hosts"
           if first.get("nodes", 1) > 1 else f"{first['hosts']} hosts")
  ax.set(xscale="log", yscale="log", ylabel="step time (ms)",
         xlabel="inter-node link rate (Mb/s)" if first.get("nodes", 1) > 1 else
         "link rate (Mb/s)",
         title=f"{where}, {first['n_params']} params (dashed: the calibrated model)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  try:
    files.save_figure_atomic(fig, path)
  finally:
    plt.close(fig)
