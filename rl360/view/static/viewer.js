// rl360 view: the page's script. Row text is only ever set with textContent (never parsed as HTML).
"use strict";

const state = { info: null, offset: 0, limit: 50, filters: {}, total: 0, selected: null };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

async function api(path, params) {
  const query = new URLSearchParams(params || {}).toString();
  const reply = await fetch(path + (query ? "?" + query : ""), { credentials: "same-origin" });
  const body = await reply.json();
  if (!reply.ok) throw new Error(body.detail || reply.statusText);
  return body;
}

function showError(error) {
  const box = document.getElementById("error");
  box.hidden = false;
  box.textContent = String(error.message || error);
}

function shown(value) {
  if (value === null || value === undefined) return "";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(4);
  return typeof value === "string" ? value : JSON.stringify(value);
}

// ---- the address keeps offset, filters and the open row, so a view can be linked ----
function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  state.offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);
  state.limit = parseInt(params.get("limit") || String(state.limit), 10) || state.limit;
  state.selected = params.has("row") ? parseInt(params.get("row"), 10) : null;
  state.filters = {};
  for (const [name, value] of params) if (!["offset", "limit", "row"].includes(name) && value) state.filters[name] = value;
}

function writeHash() {
  const params = new URLSearchParams({ offset: state.offset, limit: state.limit, ...state.filters });
  if (state.selected !== null) params.set("row", state.selected);
  history.replaceState(null, "", "#" + params.toString());
}

// ---- summary: an eval's report, a run's curves ----
function reportTable(report) {
  const rule = report.rule, combined = report.combined;
  const head = ["data_source", "prompts", "samples", "accuracy", "pass@1", `maj@${report.n}`];
  if (combined) head.push("accuracy + judge");
  const table = el("table", {}, el("tr", {}, ...head.map((h) => el("th", { text: h }))));
  const names = [...Object.keys(rule.by_data_source), "all"];
  for (const name of names) {
    const m = name === "all" ? rule.all : rule.by_data_source[name];
    const cells = [name, m.prompts, m.samples, m.accuracy, m["pass@1"], m[`maj@${report.n}`]];
    if (combined) cells.push((name === "all" ? combined.all : combined.by_data_source[name]).accuracy);
    table.append(el("tr", {}, ...cells.map((c) => el("td", { text: shown(c) }))));
  }
  return table;
}

function curveSvg(name, steps, values) {
  const w = 260, h = 90, pad = 4, ns = "http://www.w3.org/2000/svg";
  const points = steps.map((s, i) => [s, values[i]]).filter(([s, v]) => s !== null && v !== null && v !== undefined);
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "curve"); svg.setAttribute("width", w); svg.setAttribute("height", h);
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", 6); label.setAttribute("y", 12);
  svg.append(label);
  if (!points.length) { label.textContent = name + ": no values"; return svg; }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = (x) => pad + (w - 2 * pad) * (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5);
  const sy = (y) => h - pad - (h - 20 - pad) * (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "));
  line.setAttribute("fill", "none"); line.setAttribute("stroke", "#1f5fbf"); line.setAttribute("stroke-width", "1.5");
  svg.append(line);
  label.textContent = `${name}: ${shown(ys[ys.length - 1])} (step ${xs[xs.length - 1]})`;
  return svg;
}

async function showSummary(info) {
  const box = document.getElementById("summary");
  box.replaceChildren();
  const summary = info.summary || {};
  if (info.kind === "eval") {
    if (summary.report) box.append(reportTable(summary.report));
    else box.append(el("p", { text: "no report.json yet: the evaluation is not scored (rows show as unscored)" }));
    if (summary.prompts_note) box.append(el("p", { text: summary.prompts_note }));
  } else {
    box.append(el("p", { text: Object.entries(summary).map(([k, v]) => `${k}: ${v}`).join(" · ") }));
  }
  if (info.curve) {
    const curve = await api("/api/curve");
    for (const [name, values] of Object.entries(curve.series)) box.append(curveSvg(name, curve.steps, values));
  }
}

// ---- filters, pager, table ----
async function showFilters() {
  const { filters } = await api("/api/filters");
  const box = document.getElementById("filters");
  box.replaceChildren();
  for (const filter of filters) {
    const select = el("select", { "data-filter": filter.name }, el("option", { value: "", text: "all" }));
    for (const option of filter.options || []) select.append(el("option", { value: option, text: option }));
    select.value = state.filters[filter.name] || "";
    select.addEventListener("change", () => {
      if (select.value) state.filters[filter.name] = select.value; else delete state.filters[filter.name];
      state.offset = 0; state.selected = null; loadPage();
    });
    box.append(el("label", { text: filter.name + " " }, select));
  }
}

function cellClass(column, value) {
  if (column === "outcome") return String(value);
  if (column === "score" && typeof value === "number") return value >= 1 ? "right" : "wrong";
  return "";
}

async function loadPage() {
  writeHash();
  document.getElementById("position").textContent = "loading…";
  const page = await api("/api/rows", { offset: state.offset, limit: state.limit, ...state.filters });
  state.total = page.total;
  const columns = state.info.columns;
  const head = document.querySelector("#rows thead"), body = document.querySelector("#rows tbody");
  head.replaceChildren(el("tr", {}, el("th", { text: "#" }), ...columns.map((c) => el("th", { text: c }))));
  body.replaceChildren();
  for (const row of page.rows) {
    const tr = el("tr", { "data-index": row.index }, el("td", { text: String(row.index) }));
    for (const column of columns) {
      const text = shown(row[column]);
      tr.append(el("td", { text, title: text.slice(0, 500), class: cellClass(column, row[column]) }));
    }
    if (row.index === state.selected) tr.classList.add("selected");
    tr.addEventListener("click", () => openRow(row.index));
    body.append(tr);
  }
  const last = Math.min(state.offset + page.rows.length, page.total);
  document.getElementById("position").textContent = page.rows.length
    ? `rows ${state.offset + 1}–${last} of ${page.total}` : `no rows at offset ${state.offset} (${page.total} in all)`;
  document.getElementById("prev").disabled = state.offset === 0;
  document.getElementById("next").disabled = state.offset + state.limit >= page.total;
  if (state.selected !== null) openRow(state.selected);
}

// ---- one row whole ----
function valueNode(value) {
  if (value && typeof value === "object" && !Array.isArray(value) && typeof value.$image === "string"
      && value.$image.startsWith("data:image/")) {
    return el("img", { src: value.$image, alt: "image" });
  }
  if (value && typeof value === "object" && "$bytes" in value) return el("span", { text: `${value.$image_type || "binary"}, ${value.$bytes} bytes` });
  if (Array.isArray(value) && value.length && value.every((m) => m && typeof m === "object" && "content" in m && "role" in m)) {
    return el("div", {}, ...value.map((m) => el("div", { class: "turn" + (m.role === "tool" ? " tool" : "") },
      el("b", { text: m.role }), valueNode(m.content))));
  }
  if (value && typeof value === "object") {
    const hasImage = JSON.stringify(value).includes('"$image"');
    if (hasImage || (!Array.isArray(value) && Object.keys(value).length <= 12)) {
      const grid = el("div", { class: "kv" });
      for (const [k, v] of Object.entries(value)) grid.append(el("div", { class: "k", text: k }), el("div", {}, valueNode(v)));
      return grid;
    }
    return el("pre", { text: JSON.stringify(value, null, 1) });
  }
  return el("pre", { text: shown(value) });
}

function diffColour(diff) {
  const strength = Math.min(1, Math.sqrt(diff / 0.5));  // 0.5 nats or more: full red
  return `hsl(${Math.round(50 - 50 * strength)}, 100%, ${Math.round(97 - 35 * strength)}%)`;
}

function tokensNode(tokens, diffs) {
  const box = el("div", { class: "tokens" });
  diffs.forEach((diff, i) => {
    const text = tokens ? tokens[i] : "▮";
    const span = el("span", { text, title: diff === null ? "not trained on" : `|Δ log-prob| ${diff}` });
    if (diff === null) span.className = "off"; else span.style.background = diffColour(diff);
    box.append(span);
  });
  return box;
}

async function openRow(index) {
  state.selected = index;
  writeHash();
  for (const tr of document.querySelectorAll("#rows tbody tr")) tr.classList.toggle("selected", Number(tr.dataset.index) === index);
  const row = await api("/api/row", { index });
  const fields = row.fields, box = document.getElementById("detail");
  box.hidden = false;
  box.replaceChildren(el("h2", { text: `row ${index}` + (row.step !== undefined ? ` · step ${row.step}` : "") +
    (row.file ? ` · ${row.file} row group ${row.row_group}` : "") }));
  const shownApart = new Set(["response_tokens", "logprob_diff", "turns"]);
  if (Array.isArray(fields.logprob_diff)) {
    box.append(el("h3", { text: "response tokens by |trainer − engine| log-prob difference" }),
      el("div", { class: "legend", text: `mean ${shown(fields.logprob_diff_mean)}, max ${shown(fields.logprob_diff_max)}; white: none, red: ≥ 0.5; grey: not trained on (tool output)` }),
      tokensNode(fields.response_tokens, fields.logprob_diff));
  }
  if (Array.isArray(fields.turns)) {
    box.append(el("h3", { text: "turns" }), ...fields.turns.map((t) => el("div", { class: "turn" + (t.generated ? "" : " tool") },
      el("b", { text: t.generated ? `model (weights v${t.version})` : "tool / environment" }), el("pre", { text: t.text }))));
  }
  for (const [name, value] of Object.entries(fields)) {
    if (shownApart.has(name)) continue;
    box.append(el("h3", { text: name }), valueNode(value));
  }
}

// ---- start ----
async function start() {
  readHash();
  document.getElementById("limit").value = String(state.limit);
  state.info = await api("/api/info");
  document.getElementById("source").textContent = `${state.info.kind}: ${state.info.path} (${state.info.total} rows)`;
  document.getElementById("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - state.limit); loadPage().catch(showError); });
  document.getElementById("next").addEventListener("click", () => { state.offset += state.limit; loadPage().catch(showError); });
  document.getElementById("limit").addEventListener("change", (e) => { state.limit = parseInt(e.target.value, 10); state.offset = 0; loadPage().catch(showError); });
  document.getElementById("goto").addEventListener("change", (e) => { state.offset = Math.max(0, parseInt(e.target.value, 10) || 0); loadPage().catch(showError); });
  await loadPage();
  await Promise.all([showFilters(), showSummary(state.info)]);
}

start().catch(showError);
