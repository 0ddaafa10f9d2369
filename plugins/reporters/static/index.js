// cbtrace tab for TensorBoard (ES module; TensorBoard calls render() inside the tab's iframe,
// whose <base> is data/plugin/cbtrace/). Lists the runs under the logdir, mounts the same
// icicle as icicle.html for the chosen one, and links its annotated traces.
// All text from the server goes into the DOM with textContent.

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

async function getJson(url) {
  const r = await fetch(url);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || (url + ": HTTP " + r.status));
  return body;
}

function traceLinks(run, traces) {
  const box = el("div", "cb-traces");
  if (!traces.length) {
    box.appendChild(el("span", "cb-note",
      "No annotated trace in this run (cbtrace annotate writes annotated_<trace> beside it)."));
    return box;
  }
  box.appendChild(el("span", "cb-group-label", "annotated trace:"));
  traces.forEach((name) => {
    const a = el("a", "cb-trace-link", name);
    a.href = "./trace?run=" + encodeURIComponent(run) + "&name=" + encodeURIComponent(name);
    a.download = name;
    box.appendChild(a);
  });
  box.appendChild(el("span", "cb-note",
    " Open it in Perfetto: download, then at ui.perfetto.dev choose \"Open trace file\" " +
    "(the file is read locally, never uploaded). The PYTORCH_PROFILER tab shows it too."));
  return box;
}

export async function render() {
  const css = document.createElement("link");
  css.rel = "stylesheet";
  css.href = "./icicle.css";
  document.head.appendChild(css);
  await import("./icicle.js");

  const page = el("div", "cb-root cb-tb");
  document.body.appendChild(page);
  const bar = el("div", "cb-toolbar");
  bar.appendChild(el("label", "cb-group-label", "run"));
  const select = el("select", "cb-run-select");
  select.setAttribute("aria-label", "run");
  bar.appendChild(select);
  const traces = el("div", "cb-trace-box");
  const status = el("p", "cb-status", "Loading runs…");
  const view = el("div", "cb-view");
  page.append(bar, traces, status, view);

  let runs;
  try {
    runs = (await getJson("./runs")).runs;
  } catch (e) {
    status.textContent = "Could not list runs: " + e.message;
    return;
  }
  if (!runs.length) {
    status.textContent = "No cbtrace runs under the logdir (a run is a directory holding " +
      "manifest.json and modules.parquet).";
    return;
  }
  runs.forEach((r) => {
    const o = el("option", null, r.name ? r.run + " — " + r.name : r.run);
    o.value = r.run;
    select.appendChild(o);
  });

  let mounted = null;
  async function show(run) {
    status.textContent = "Loading " + run + "…";
    if (mounted) mounted.destroy();
    mounted = null;
    try {
      const data = await getJson("./data?run=" + encodeURIComponent(run));
      traces.textContent = "";
      traces.appendChild(traceLinks(run, data.traces || []));
      mounted = globalThis.cbtraceIcicle.mount(view, data);
      status.textContent = "";
      page.dataset.run = run;
    } catch (e) {
      status.textContent = "Could not load " + run + ": " + e.message;
    }
  }
  select.addEventListener("change", () => show(select.value));
  await show(runs[0].run);
}
