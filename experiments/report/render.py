"""A report as a list of blocks, rendered twice: to Markdown and to self-contained HTML (images as
files beside it, wide tables scrolling in their own box).

Blocks: ("h", level, text), ("p", text), ("ul", [text]), ("table", header, rows), ("code", text),
("img", {"path", "svg", ...}, caption), ("links", [(text, href)]), ("example", {title, prompt,
expected, outputs: [(who, text, verdict)]}).
"""

from __future__ import annotations

import html


def _fence(text: str) -> str:
    return "```text\n" + text.replace("```", "ʼʼʼ") + "\n```"


def _example_md(x: dict) -> str:
    return "\n\n".join([f"**{x['title']}**", "Prompt (the user's message, chat markup removed):", _fence(x["prompt"]),
                        f"Expected: {x['expected']}"]
                       + [f"{who}: **{verdict}**\n\n{_fence(text)}" for who, text, verdict in x["outputs"]])


def _example_html(x: dict) -> str:
    e = html.escape
    outputs = "".join(f"<dt>{e(who)}: <b>{e(verdict)}</b></dt><dd><pre class='text'>{e(text)}</pre></dd>"
                      for who, text, verdict in x["outputs"])
    return (f"<div class='example'><h4>{e(x['title'])}</h4><dl><dt>Prompt (the user's message, chat markup removed)</dt>"
            f"<dd><pre class='text'>{e(x['prompt'])}</pre></dd><dt>Expected</dt><dd>{e(x['expected'])}</dd>{outputs}</dl></div>")


def render_md(blocks: list[tuple]) -> str:
    out = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            out.append("#" * b[1] + " " + b[2])
        elif kind == "p":
            out.append(b[1])
        elif kind == "ul":
            out.append("\n".join(f"- {x}" for x in b[1]))
        elif kind == "table":
            header, rows = b[1], b[2]
            out.append("\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                                 + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]))
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]['path']})\n\n*{b[2]}* ([PNG]({b[1]['path']}), [SVG]({b[1]['svg']}))")
        elif kind == "links":
            out.append("\n".join(f"- [{text}]({href})" for text, href in b[1]))
        elif kind == "example":
            out.append(_example_md(b[1]))
        elif kind == "code":
            out.append("```\n" + b[1] + "\n```")
    return "\n\n".join(out) + "\n"


STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}"
         ".table{overflow-x:auto;max-width:100%;margin:1em 0}"  # wide tables scroll inside their box, not the page
         "table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #bbb;padding:.25em .6em;text-align:right;"
         "vertical-align:top}th{background:#eee}td:first-child,th:first-child{text-align:left}"
         "img{max-width:100%}figure{margin:1.5em 0}figcaption{font-size:.9em;color:#444}"
         "pre{background:#f5f5f5;padding:1em;overflow:auto}pre.text{white-space:pre-wrap;word-break:break-word;padding:.5em;margin:.2em 0}"
         ".example{border:1px solid #ddd;padding:.5em 1em;margin:1em 0}dd{margin-left:1em}")


def render_html(blocks: list[tuple], title: str) -> str:
    e = html.escape
    body = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            body.append(f"<h{b[1]}>{e(b[2])}</h{b[1]}>")
        elif kind == "p":
            body.append(f"<p>{e(b[1])}</p>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{e(h)}</th>" for h in b[1])
            rows = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in b[2])
            body.append(f"<div class='table'><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>")
        elif kind == "img":
            f = b[1]
            body.append(f'<figure><a href="{e(f["path"])}"><img src="{e(f["path"])}" alt="{e(b[2])}"></a>'
                        f'<figcaption>{e(b[2])} (<a href="{e(f["path"])}">PNG</a>, <a href="{e(f["svg"])}">SVG</a>)</figcaption></figure>')
        elif kind == "links":
            body.append("<ul>" + "".join(f'<li><a href="{e(href)}">{e(text)}</a></li>' for text, href in b[1]) + "</ul>")
        elif kind == "example":
            body.append(_example_html(b[1]))
        elif kind == "code":
            body.append(f"<pre>{e(b[1])}</pre>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{STYLE}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")
