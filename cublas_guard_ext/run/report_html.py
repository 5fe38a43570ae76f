"""The incident report as one self-contained HTML page (inline CSS and SVG, no script, no
network), and the index of a folder's reports. Pure functions of :func:`incident.facts`'s data.
"""

from __future__ import annotations

import html
import os
from typing import Any

_CSS = """
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
 color:#1d2330;background:#f4f5f8}
main{max-width:1060px;margin:0 auto;padding:20px 24px 40px}
header{background:#1d2330;color:#fff;padding:18px 24px 20px;border-bottom:4px solid #d93a3a}
header.peer{border-bottom-color:#e0a100}
header .inner{max-width:1060px;margin:0 auto}
.kicker{font-size:12px;letter-spacing:.04em;text-transform:uppercase;color:#aeb6c8}
h1{margin:4px 0 6px;font-size:24px;font-weight:650}
.headline{margin:0;font-size:15px;color:#e9ecf3;max-width:980px}
h2{font-size:15px;margin:0 0 10px;color:#3a4357;text-transform:uppercase;letter-spacing:.05em}
section{background:#fff;border:1px solid #dde1ea;border-radius:8px;padding:16px 18px;margin:16px 0}
.cards{display:grid;grid-template-columns:1.7fr 1.7fr 1.2fr .9fr .6fr .6fr;gap:10px}
.statrow{display:flex;gap:28px;align-items:flex-start;flex-wrap:wrap}
.statrow p{margin:2px 0 8px}
.card{border:1px solid #e3e6ee;border-radius:6px;padding:8px 10px;background:#fafbfd}
.card .k{font-size:11px;text-transform:uppercase;color:#6b7487;letter-spacing:.04em}
.card .v{font:600 13px/1.3 ui-monospace,"DejaVu Sans Mono",Menlo,monospace;overflow-wrap:anywhere}
.card.hot{border-color:#d93a3a;background:#fff4f4}
.two{display:grid;grid-template-columns:minmax(0,1.15fr) minmax(0,1fr);gap:18px}
code,pre,.mono{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,monospace;font-size:12.5px}
pre{background:#f6f7fa;border:1px solid #e3e6ee;border-radius:6px;padding:10px;overflow:auto;
 white-space:pre-wrap;margin:6px 0}
.note{background:#fff7e0;border-left:4px solid #e0a100;padding:8px 12px;border-radius:4px;margin:8px 0}
.range{background:#fff0f0;border-left:4px solid #d93a3a;padding:8px 12px;border-radius:4px;
 margin:8px 0;font-weight:600}
ol.path{list-style:none;padding:0;margin:0}
ol.path li{position:relative;padding:6px 10px 6px 30px;margin:0 0 14px;border:1px solid #e3e6ee;
 border-radius:6px;background:#fafbfd;font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12.5px}
ol.path li:before{content:"";position:absolute;left:12px;top:11px;width:9px;height:9px;border-radius:50%;
 background:#8a93a6}
ol.path li:not(:last-child):after{content:"\\2193";position:absolute;left:12px;bottom:-16px;color:#8a93a6}
ol.path li.birth{border-color:#d93a3a;background:#fff4f4;font-weight:700}
ol.path li.birth:before{background:#d93a3a}
ol.path li.sink{border-color:#e0a100;background:#fff9e8}
table{border-collapse:collapse;width:100%}
td,th{text-align:left;padding:4px 8px;border-bottom:1px solid #eef0f4;vertical-align:top}
th{color:#6b7487;font-weight:600;font-size:12px;width:170px}
.cmd{margin:0 0 12px}
.cmd .what{color:#3a4357;margin-bottom:2px}
.cmd pre{background:#1d2330;color:#e9ecf3;border:none}
.muted{color:#6b7487}
details summary{cursor:pointer;color:#3a4357;font-weight:600}
svg text{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,monospace;font-size:12px}
a{color:#2557c5}
table.index th{width:auto}
table.index td.err{width:55%}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _card(key: str, value: Any, hot: bool = False) -> str:
    shown = "—" if value is None or value == "" else value
    return f'<div class="card{" hot" if hot else ""}"><div class="k">{_e(key)}</div><div class="v">{_e(shown)}</div></div>'


def _count_bars(stats: dict[str, Any]) -> str:
    """A small SVG bar chart of NaN / +Inf / -Inf / zeros."""
    rows = [
        ("NaN", stats.get("nan_count"), "#d93a3a"),
        ("+Inf", stats.get("posinf_count"), "#e07a00"),
        ("-Inf", stats.get("neginf_count"), "#b15cd6"),
        ("zeros", stats.get("zero_count"), "#8a93a6"),
    ]
    rows = [r for r in rows if r[1] is not None]
    if not rows:
        return ""
    largest = max(int(r[1]) for r in rows) or 1
    height = 24 * len(rows) + 4
    parts = [f'<svg class="counts" width="380" height="{height}" role="img" aria-label="counts">']
    for i, (label, count, color) in enumerate(rows):
        y = 4 + 24 * i
        width = 0 if not count else max(3, int(240 * int(count) / largest))
        parts.append(f'<text x="0" y="{y + 13}" fill="#3a4357">{_e(label)}</text>')
        parts.append(f'<rect x="56" y="{y}" width="{width}" height="16" rx="3" fill="{color}"/>')
        parts.append(f'<text x="{62 + width}" y="{y + 13}" fill="#1d2330">{_e(count)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _statistics(stats: dict[str, Any] | None, where: dict[str, Any]) -> str:
    if not stats:
        return ""
    if where.get("op"):
        title, at = "Statistics at the producing op", f"at {where['op']}"
    else:  # a guarded layer's input check: where the values arrived, not where they were born
        title = "Statistics of the bad values"
        at = f"in the input of layer {where.get('layer') or '?'} (where they were born: --watch names it)"
    out = [f'<section id="statistics"><h2>{title}</h2>']
    out.append(
        f'<p class="muted">{_e(at)}, dtype {_e(stats.get("dtype"))}'
        + (f", shape {_e(stats.get('shape'))}" if stats.get("shape") else "")
        + "</p>"
    )
    out.append('<div class="statrow">' + _count_bars(stats) + "<div>")
    if stats.get("counts_line"):
        out.append(f'<p class="mono" data-field="counts">{_e(stats["counts_line"])}</p>')
    if stats.get("magnitude_line"):
        line = stats["magnitude_line"]
        if stats.get("range_note"):  # said below, highlighted
            line = line.replace(f" ({stats['range_note']})", "")
        out.append(f'<p class="mono" data-field="input_absmax">{_e(line)}</p>')
    if stats.get("range_note"):
        out.append(f'<div class="range" data-field="range_note">{_e(stats["range_note"])}</div>')
    if stats.get("first_bad_coords") is not None:
        value = stats.get("first_bad_value")
        out.append(
            f'<p class="muted">first bad element at {_e(stats["first_bad_coords"])}'
            + (f" ({_e(value)})" if value is not None else "")
            + "</p>"
        )
    out.append("</div></div></section>")
    return "".join(out)


def _tree_svg(tree: dict[str, Any], birth_op: str | None) -> str:
    """The module tree: one row per module, the birth module and its ancestors in red, the birth
    op as a red diamond right under its module."""
    rows: list[tuple[str, dict[str, Any]]] = []
    for node in tree["nodes"]:
        rows.append(("module", node))
        if node["birth"] and birth_op:
            rows.append(("op", {"depth": node["depth"] + 1, "name": birth_op}))
    step, indent, top, width = 22, 18, 14, 540
    height = top + step * len(rows)
    parts = [
        f'<svg class="tree" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        'aria-label="module tree">'
    ]
    last_at_depth: dict[int, int] = {}
    for i, (kind, node) in enumerate(rows):
        y, depth = top + step * i, node["depth"]
        x = 10 + indent * depth
        red = kind == "op" or node["on_path"]
        if depth > 0 and depth - 1 in last_at_depth:
            parent_y = top + step * last_at_depth[depth - 1]
            px = 10 + indent * (depth - 1)
            dash = ' stroke-dasharray="4 2"' if kind == "op" else ""
            parts.append(
                f'<path d="M{px} {parent_y + 5} V{y} H{x - 6}" fill="none" stroke="{"#d93a3a" if red else "#c3c8d4"}" '
                f'stroke-width="{2 if red else 1}"{dash}/>'
            )
        if kind == "op":
            parts.append(
                f'<g class="birth-op" data-birth-op="{_e(node["name"])}"><rect x="{x - 5}" y="{y - 5}" width="10" '
                f'height="10" fill="#d93a3a" transform="rotate(45 {x} {y})"/><text x="{x + 12}" y="{y + 4}" '
                f'fill="#b32020" font-weight="700">{_e(node["name"])}<tspan font-weight="400"> born here'
                "</tspan></text></g>"
            )
            continue
        last_at_depth[depth] = i
        for deeper in [d for d in last_at_depth if d > depth]:
            del last_at_depth[deeper]
        cls = "birth" if node["birth"] else ("path" if node["on_path"] else "node")
        fill = "#d93a3a" if node["birth"] else ("#ffd9d9" if node["on_path"] else "#fff")
        label = node["name"].rpartition(".")[2] if node["name"] else "(model)"
        weight = ' font-weight="700"' if node["on_path"] else ""
        parts.append(
            f'<g class="{cls}" data-module="{_e(node["name"])}">'
            f'<circle cx="{x}" cy="{y}" r="5" fill="{fill}" stroke="{"#d93a3a" if red else "#8a93a6"}" '
            f'stroke-width="1.5"/><text x="{x + 10}" y="{y + 4}" fill="{"#b32020" if red else "#1d2330"}"{weight}>'
            f'{_e(label)}<tspan fill="#8a93a6" font-weight="400"> {_e(node["type"])}</tspan></text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _where_section(data: dict[str, Any]) -> str:
    tree, path, where = data.get("module_tree"), data.get("path"), data["where"]
    if not tree and not path:
        return ""
    left = ""
    if tree:
        what = (
            "the modules on the value's way in red" if path else "the failing module and its parents in red"
        )
        left = f'<div><p class="muted">{_e(tree["root_type"])}: {_e(what)}</p>'
        left += _tree_svg(tree, where.get("op") if path else None)
        if tree.get("hidden"):
            left += f'<p class="muted">{tree["hidden"]} modules off the path are folded away</p>'
        left += "</div>"
    right = ""
    if path:
        items = []
        for i, step in enumerate(path["steps"]):
            cls = "birth" if i == 0 else ("sink" if step.startswith("reached") else "")
            items.append(f'<li class="{cls}">{_e(step)}</li>')
        right = (
            f'<div><p class="muted">the way the value went ({_e(path["phase"])})</p>'
            f'<ol class="path">{"".join(items)}</ol><p class="note">{_e(path["missing"])}</p></div>'
        )
    title = "Where it was born and where it went" if path else "The model"
    return f'<section id="where"><h2>{title}</h2><div class="two">{left}{right}</div></section>'


def _call_section(data: dict[str, Any]) -> str:
    call, capsule = dict(data.get("cublas_call") or {}), data.get("capsule")
    if not call and not capsule and not data.get("capsule_note"):
        return ""
    out = ['<section id="cublas"><h2>The call as cuBLAS got it</h2>']
    if call.get("status_name"):
        out.append(f"<p><b>{_e(call.pop('status_name'))}</b> {_e(call.pop('meaning', ''))}</p>")
    if "m" in call:
        args = ", ".join(
            f"{k}={call.pop(k)}"
            for k in ("transa", "transb", "m", "n", "k", "alpha", "lda", "ldb", "beta", "ldc")
            if k in call
        )
        out.append(f"<pre>{_e(call.pop('api', 'gemm'))}({_e(args)})</pre>")
    operands = []
    for op in ("a", "b", "c"):
        if f"{op}_shape" in call:
            cells = [call.pop(f"{op}_{part}", None) for part in ("role", "shape", "strides", "dtype")]
            operands.append(
                f'<tr><td class="mono">{op.upper()}</td>'
                + "".join(f'<td class="mono">{_e(c)}</td>' for c in cells)
                + "</tr>"
            )
    if operands:
        out.append(
            "<table><tr><th>operand</th><th>role</th><th>shape</th><th>strides</th><th>dtype</th></tr>"
            + "".join(operands)
            + "</table>"
        )
    rest = "".join(f'<tr><th>{_e(k)}</th><td class="mono">{_e(v)}</td></tr>' for k, v in call.items())
    if rest:
        out.append(f"<table>{rest}</table>")
    if capsule:
        out.append(f'<p>capsule: <span class="mono">{_e(capsule)}</span></p>')
        out.append(f"<pre>python -m cublas_guard_ext replay {_e(capsule)}</pre>")
    elif data.get("capsule_note"):
        out.append(f'<p class="note">capsule not written: {_e(data["capsule_note"])}</p>')
    out.append("</section>")
    return "".join(out)


def _doctor_section(data: dict[str, Any]) -> str:
    doctor = data.get("doctor")
    if not doctor:
        return ""
    summary = doctor.get("summary") or {}
    line = ", ".join(f"{v} {k}" for k, v in summary.items()) if summary else ""
    return (
        f'<section id="doctor"><h2>Doctor</h2><p>{_e(line)}</p>'
        f"<details><summary>the checklist</summary><pre>{_e(doctor.get('text'))}</pre></details></section>"
    )


def _commands_section(data: dict[str, Any]) -> str:
    items = []
    for step in data.get("next_steps") or []:
        items.append(f'<div class="cmd"><div class="what">{_e(step)}</div></div>')
    for cmd in data.get("next_commands") or []:
        items.append(
            f'<div class="cmd"><div class="what">{_e(cmd["what"])}</div><pre>{_e(cmd["command"])}</pre></div>'
        )
    if not items:
        return ""
    return f'<section id="next"><h2>Next things to try</h2>{"".join(items)}</section>'


def _verdict_section(data: dict[str, Any]) -> str:
    """The rerun verdict of a training step: what, on which rank and device, where, why."""
    v = data.get("verdict")
    if not v:
        return ""
    hardware = v["verdict"] in ("transient", "persistent", "replicas_differ")
    cards = [
        _card("verdict", v["verdict"], hot=hardware),
        _card("rank", v.get("rank"), hot=hardware and v.get("rank") is not None),
        _card("host", v.get("host")),
        _card("device", v.get("device")),
        _card("GPU UUID", v.get("gpu_uuid")),
        _card("step", v.get("step")),
    ]
    rows = [
        (k, v["where"][k]) for k in ("parameter", "module", "phase", "what", "gemm", "op") if k in v["where"]
    ]
    rows += [
        (k, v[k]) for k in ("trigger", "comparison", "ranks", "exit_code", "capsule") if v.get(k) is not None
    ]
    table = "".join(
        f'<tr><th>{_e(k)}</th><td class="mono" data-field="{_e(k)}">{_e(x)}</td></tr>' for k, x in rows
    )
    replays = ""
    if v.get("replays"):
        replays = (
            "<p class=\"muted\">each rank's replay of the same GEMM operands (the named rank's differs)</p>"
            "<table><tr><th>rank</th><th>host</th><th>device</th><th>signature</th></tr>"
            + "".join(
                f'<tr><td class="mono">{_e(r.get("rank"))}</td><td class="mono">{_e(r.get("host"))}</td>'
                f'<td class="mono">{_e(r.get("device"))}</td><td class="mono">{_e(r.get("signature"))}</td></tr>'
                for r in v["replays"]
            )
            + "</table>"
        )
    return (
        f'<section id="verdict"><h2>The rerun verdict</h2><div class="cards">{"".join(cards)}</div>'
        f"<table>{table}</table>{replays}</section>"
    )


def _peer_section(data: dict[str, Any]) -> str:
    peer = data.get("peer")
    if not peer:
        return ""
    report = peer.get("report") or ""
    here = data.get("report") or ""
    link = report
    if report and here and os.path.dirname(report) == os.path.dirname(here):
        link = os.path.basename(report)
    ref = f'<a href="{_e(link)}">{_e(report)}</a>' if report else "(not written)"
    return (
        '<section id="peer"><h2>The rank that failed first</h2><table>'
        f'<tr><th>rank</th><td class="mono">{_e(peer.get("rank"))}</td></tr>'
        f'<tr><th>host / pid</th><td class="mono">{_e(peer.get("host"))} / {_e(peer.get("pid"))}</td></tr>'
        f'<tr><th>error</th><td class="mono">{_e(peer.get("error"))}</td></tr>'
        f"<tr><th>its report</th><td>{ref}</td></tr></table></section>"
    )


def render(data: dict[str, Any]) -> str:
    error, where = data["error"], data["where"]
    first_line = (error.get("message") or "").splitlines()[0] if error.get("message") else ""
    peer = data.get("peer")
    rank = data.get("rank")
    who = [f"host {data.get('host')}", f"pid {data.get('pid')}"]
    if rank is not None:
        who.insert(
            1,
            f"rank {rank}"
            + (f" (local {data.get('local_rank')})" if data.get("local_rank") is not None else ""),
        )
    title = f"{error['class']}" + (f" on rank {rank}" if rank is not None else "")
    if peer:  # this rank did nothing wrong: say whose failure stopped it
        cards = [
            _card("stopped because of rank", peer.get("rank"), hot=True),
            _card("its error", str(peer.get("error") or "").split(":")[0], hot=True),
            _card("its host / pid", f"{peer.get('host')} / {peer.get('pid')}"),
            _card("this rank's step", where.get("step")),
            _card("rank", rank),
        ]
    else:
        cards = [
            _card("op", where.get("op"), hot=bool(where.get("op"))),
            _card("module", where.get("module"), hot=where.get("module") not in (None, "")),
            _card("layer", where.get("layer")),
            _card("phase", where.get("phase")),
            _card("step", where.get("step")),
            _card("rank", rank),
        ]
    raised = (
        f' <span class="muted">(raised as {_e(error["raised_as"])})</span>' if error.get("raised_as") else ""
    )
    body = [
        f'<header class="{"peer" if peer else "bad"}"><div class="inner">',
        f'<div class="kicker">cublas_guard_ext incident report · {_e(" · ".join(who))} · {_e(data.get("created"))}</div>',
        f'<h1>{_e(error["class"])}{raised}</h1><p class="headline">{_e(first_line)}</p></div></header><main>',
        f'<section id="what"><h2>What failed</h2><div class="cards">{"".join(cards)}</div>'
        f'<p class="muted">command: <span class="mono">{_e(" ".join(data.get("command") or []))}</span></p></section>',
        _peer_section(data),
        _verdict_section(data),
        _statistics(data.get("statistics"), where),
        _where_section(data),
        _call_section(data),
        _doctor_section(data),
        _commands_section(data),
        f'<section id="message"><h2>The message</h2><pre>{_e(error.get("message"))}</pre>'
        f"<details><summary>traceback</summary><pre>{_e(error.get('traceback'))}</pre></details></section>",
        f'<p class="muted">the same facts as JSON: {_e(data.get("report_json"))}</p></main>',
    ]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)} · cublas_guard_ext incident</title><style>{_CSS}</style></head><body>"
        + "".join(body)
        + "</body></html>\n"
    )


def render_index(reports: list[dict[str, Any]]) -> str:
    """One row per report of the folder: rank, host, PID, the error, where, a link."""

    def order(r: dict[str, Any]) -> tuple:
        return (
            r.get("peer") is not None,
            r.get("rank") if r.get("rank") is not None else 1 << 30,
            r.get("pid") or 0,
        )

    rows = []
    for r in sorted(reports, key=order):
        where = r.get("where") or {}
        place = " in ".join(str(x) for x in (where.get("op"), where.get("module")) if x)
        error = r.get("error") or {}
        first = (error.get("message") or "").splitlines()[0] if error.get("message") else ""
        rows.append(
            f'<tr><td class="mono">{_e(r.get("rank"))}</td><td class="mono">{_e(r.get("host"))}</td>'
            f'<td class="mono">{_e(r.get("pid"))}</td><td class="err"><b>{_e(error.get("class"))}</b><br>'
            f'<span class="muted">{_e(first[:200])}</span></td><td class="mono">{_e(place)}</td>'
            f'<td><a href="{_e(os.path.basename(str(r.get("report") or r.get("stem", "") + ".html")))}">report</a></td></tr>'
        )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>cublas_guard_ext incident reports'
        f'</title><style>{_CSS}</style></head><body><header><div class="inner"><div class="kicker">'
        f'cublas_guard_ext</div><h1>{len(reports)} incident reports</h1><p class="headline">the first failure '
        'is listed first; the others stopped because of it</p></div></header><main><section><table class="index">'
        "<tr><th>rank</th><th>host</th><th>pid</th><th>error</th><th>where</th><th></th></tr>"
        + "".join(rows)
        + "</table></section></main></body></html>\n"
    )
