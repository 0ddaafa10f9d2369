// cbtrace icicle: renders the model built by cbtrace/plugins/reporters/icicle_model.py.
// A classic script (inlined in icicle.html, imported by the TensorBoard tab's index.js) that
// defines globalThis.cbtraceIcicle.mount(container, data). Every module name and figure is
// put in the page with textContent, never parsed as HTML. Layout, colours and number
// formatting come precomputed from Python; this file maps [x0, x1] to pixels, zooms,
// searches and sorts.
(function () {
  "use strict";
  var ROW = 22;          // px per tree level
  var MIN_PX = 0.5;      // narrower nodes (and their subtrees) are not drawn
  var MAX_ROWS = 1000;   // table rows rendered at once (search narrows the rest)

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function mount(container, data) {
    var byId = new Map();
    var kids = new Map();
    data.nodes.forEach(function (n) {
      byId.set(n.id, n);
      kids.set(n.id, []);
    });
    data.nodes.forEach(function (n) { if (n.p !== null) kids.get(n.p).push(n.id); });
    // a column is right-aligned when any row holds a number in it
    var numeric = data.columns.map(function (_, i) {
      return data.nodes.some(function (n) { return n.cells && typeof n.cells[i][0] === "number"; });
    });
    var defaultSort = data.columns.indexOf(data.modes[0] === "insitu" ? "in-situ" : "isolated");
    var state = {
      mode: data.modes[0], scheme: "metric", zoom: data.root, query: "",
      sortCol: data.modes[0] === "calls" ? -1 : defaultSort, sortDir: -1,
    };

    container.textContent = "";
    container.classList.add("cb-root");
    var head = el("header", "cb-head");
    head.appendChild(el("h1", "cb-title", data.title));
    if (data.subtitle) head.appendChild(el("div", "cb-subtitle", data.subtitle));
    container.appendChild(head);

    var bar = el("div", "cb-toolbar");
    var modeGroup = el("span", "cb-group");
    modeGroup.appendChild(el("span", "cb-group-label", "width"));
    data.modes.forEach(function (m) {
      var b = el("button", "cb-mode", data.mode_labels[m]);
      b.type = "button";
      b.dataset.mode = m;
      b.addEventListener("click", function () { state.mode = m; render(); });
      modeGroup.appendChild(b);
    });
    var schemeGroup = el("span", "cb-group");
    schemeGroup.appendChild(el("span", "cb-group-label", "colour"));
    // "speedup" is offered only when the run has speedup figures (a replay with --modes)
    (data.schemes || [["metric", "MFU / MBU"], ["bound", "bound"]]).forEach(function (s) {
      var b = el("button", "cb-scheme", s[1]);
      b.type = "button";
      b.dataset.scheme = s[0];
      b.addEventListener("click", function () { state.scheme = s[0]; render(); });
      schemeGroup.appendChild(b);
    });
    var search = el("input", "cb-search");
    search.type = "search";
    search.placeholder = "search modules (name or type)";
    search.setAttribute("aria-label", "search modules");
    var matchCount = el("span", "cb-matches", "");
    search.addEventListener("input", function () {
      state.query = search.value.trim().toLowerCase();
      render();
    });
    bar.appendChild(modeGroup);
    bar.appendChild(schemeGroup);
    bar.appendChild(search);
    bar.appendChild(matchCount);
    container.appendChild(bar);

    var crumbs = el("nav", "cb-crumbs");
    crumbs.setAttribute("aria-label", "zoom path");
    container.appendChild(crumbs);
    var chart = el("div", "cb-chart");
    container.appendChild(chart);
    var legend = el("div", "cb-legend");
    container.appendChild(legend);
    var note = el("p", "cb-note");
    container.appendChild(note);
    var tip = el("div", "cb-tip");
    tip.hidden = true;
    container.appendChild(tip);
    var table = el("table", "cb-table");
    container.appendChild(table);

    function matches(n) {
      if (!state.query || n.k !== "module") return false;
      return (n.q + " " + n.n + " " + n.t).toLowerCase().indexOf(state.query) >= 0;
    }

    function zoomTo(id) {
      if (!byId.has(id)) return;
      state.zoom = id;
      renderCrumbs();
      renderChart();
      table.querySelectorAll("tr.cb-current").forEach(function (tr) {
        tr.classList.remove("cb-current");
      });
      var row = table.querySelector("tr[data-id='" + id + "']");  // ids are c<int>/r<int>/root
      if (row) row.classList.add("cb-current");
    }

    function renderButtons() {
      bar.querySelectorAll(".cb-mode").forEach(function (b) {
        b.setAttribute("aria-pressed", String(b.dataset.mode === state.mode));
      });
      bar.querySelectorAll(".cb-scheme").forEach(function (b) {
        b.setAttribute("aria-pressed", String(b.dataset.scheme === state.scheme));
      });
    }

    function renderCrumbs() {
      crumbs.textContent = "";
      var path = [];
      for (var id = state.zoom; id !== null; id = byId.get(id).p) path.unshift(id);
      path.forEach(function (id, i) {
        if (i) crumbs.appendChild(el("span", "cb-sep", "›"));
        var n = byId.get(id);
        var last = i === path.length - 1;
        var c = el(last ? "span" : "button", "cb-crumb", n.n);
        c.dataset.id = id;
        if (last) c.setAttribute("aria-current", "true");
        else {
          c.type = "button";
          c.addEventListener("click", function () { zoomTo(id); });
        }
        crumbs.appendChild(c);
      });
    }

    function renderChart() {
      chart.textContent = "";
      var z = byId.get(state.zoom);
      var z0 = z.x[state.mode][0];
      var span = z.x[state.mode][1] - z0;
      var W = chart.clientWidth || 1000;
      container.dataset.zoom = state.zoom;
      container.dataset.mode = state.mode;
      if (!(span > 0)) {
        chart.appendChild(el("p", "cb-empty", "This module has no " +
          data.mode_labels[state.mode] + " figure: nothing to draw in this mode."));
        chart.style.height = "";
        return;
      }
      var maxDepth = z.d;
      var frag = document.createDocumentFragment();
      var stack = [state.zoom];
      while (stack.length) {
        var n = byId.get(stack.pop());
        var x = n.x[state.mode];
        var w = (x[1] - x[0]) / span * W;
        if (w < MIN_PX) continue;
        var d = el("div", "cb-node cb-" + n.k);
        d.dataset.id = n.id;
        d.style.left = ((x[0] - z0) / span * W) + "px";
        d.style.width = w + "px";
        d.style.top = ((n.d - z.d) * ROW) + "px";
        d.style.background = n.bg[state.scheme];
        d.style.color = n.fg[state.scheme];
        if (n.id === state.zoom) d.classList.add("cb-zoomed");
        if (state.query) d.classList.add(matches(n) ? "cb-match" : "cb-dim");
        if (w > 28) {
          var label = state.scheme === "speedup" ? n.s : n.m;
          d.textContent = n.n + " · " + n.v[state.mode] + (label ? " · " + label : "");
        }
        frag.appendChild(d);
        maxDepth = Math.max(maxDepth, n.d);
        var c = kids.get(n.id);
        for (var i = c.length - 1; i >= 0; i--) stack.push(c[i]);
      }
      chart.style.height = ((maxDepth - z.d + 1) * ROW) + "px";
      chart.appendChild(frag);
    }

    function swatch(color, label) {
      var s = el("span", "cb-swatch-item");
      var box = el("span", "cb-swatch");
      box.style.background = color;
      s.appendChild(box);
      s.appendChild(el("span", null, label));
      return s;
    }

    function gradient(scale, label, lo, hi) {
      var s = el("span", "cb-swatch-item");
      s.appendChild(el("span", null, label + " " + (lo || "0%")));
      var g = el("span", "cb-gradient");
      g.style.background = "linear-gradient(to right, " + scale[0] + ", " + scale[1] + ")";
      s.appendChild(g);
      s.appendChild(el("span", null, hi || "100%"));
      return s;
    }

    function renderLegend() {
      legend.textContent = "";
      var L = data.legend;
      if (state.scheme === "metric") {
        legend.appendChild(gradient(L.mfu, "MFU"));
        legend.appendChild(gradient(L.mbu, "MBU (no FLOPs, memory-bound, or MBU > MFU)"));
      } else if (state.scheme === "speedup") {
        legend.appendChild(gradient(L.speedup, "speedup of the fastest mode (compile, CUDA " +
          "graph) over the eager step: 1x (eager)", null, ">= " + L.speedup_max + "x"));
      } else {
        Object.keys(L.bound).forEach(function (k) { legend.appendChild(swatch(L.bound[k], k)); });
      }
      legend.appendChild(swatch(L.none, "no figures"));
      legend.appendChild(swatch(L.residual, "(self): a parent's own kernels"));
      note.textContent = data.notes[state.mode] +
        " Click a module to zoom; the path above goes back; Esc resets.";
    }

    function compare(a, b) {
      var x = a.cells[state.sortCol][0], y = b.cells[state.sortCol][0];
      if (x === y) return 0;
      if (x === null || x === undefined) return 1;   // missing values sort last
      if (y === null || y === undefined) return -1;
      if (typeof x === "string" || typeof y === "string") {
        return state.sortDir * String(x).localeCompare(String(y));
      }
      return state.sortDir * (x < y ? -1 : 1);
    }

    function renderTable() {
      table.textContent = "";
      var thead = el("thead");
      var hr = el("tr");
      data.columns.forEach(function (name, i) {
        var th = el("th", null, name);
        th.dataset.col = String(i);
        th.setAttribute("aria-sort", i !== state.sortCol ? "none"
          : (state.sortDir < 0 ? "descending" : "ascending"));
        th.addEventListener("click", function () {
          if (state.sortCol === i) state.sortDir = -state.sortDir;
          else { state.sortCol = i; state.sortDir = i < 3 ? 1 : -1; }
          renderTable();
        });
        hr.appendChild(th);
      });
      thead.appendChild(hr);
      table.appendChild(thead);
      var rows = data.nodes.filter(function (n) {
        return n.cells && (!state.query || matches(n));
      });
      if (state.sortCol >= 0) rows = rows.slice().sort(compare);
      var tbody = el("tbody");
      rows.slice(0, MAX_ROWS).forEach(function (n) {
        var tr = el("tr");
        tr.dataset.id = n.id;
        if (n.id === state.zoom) tr.classList.add("cb-current");
        n.cells.forEach(function (c, i) {
          var td = el("td", numeric[i] ? "cb-num" : null, c[1]);
          tr.appendChild(td);
        });
        tr.addEventListener("click", function () {
          zoomTo(n.id);
          chart.scrollIntoView({block: "nearest"});
        });
        tbody.appendChild(tr);
      });
      table.appendChild(tbody);
      if (rows.length > MAX_ROWS) {
        var more = el("caption", "cb-more",
          "showing " + MAX_ROWS + " of " + rows.length + " rows; search to narrow");
        table.appendChild(more);
      }
    }

    function render() {
      renderButtons();
      renderCrumbs();
      renderChart();
      renderLegend();
      renderTable();
      if (state.query) {
        var k = data.nodes.filter(matches).length;
        matchCount.textContent = k + (k === 1 ? " match" : " matches");
      } else {
        matchCount.textContent = "";
      }
    }

    function showTip(n, ev) {
      tip.textContent = "";
      tip.appendChild(el("div", "cb-tip-title", n.q || n.n));
      var t = el("table");
      n.tip.forEach(function (line) {
        var tr = el("tr");
        tr.appendChild(el("th", null, line[0]));
        tr.appendChild(el("td", null, line[1]));
        t.appendChild(tr);
      });
      tip.appendChild(t);
      tip.hidden = false;
      var pad = 14;
      var r = tip.getBoundingClientRect();
      var left = ev.clientX + pad, top = ev.clientY + pad;
      if (left + r.width > window.innerWidth) left = Math.max(0, ev.clientX - r.width - pad);
      if (top + r.height > window.innerHeight) top = Math.max(0, ev.clientY - r.height - pad);
      tip.style.left = left + "px";
      tip.style.top = top + "px";
    }

    chart.addEventListener("mousemove", function (ev) {
      var t = ev.target.closest ? ev.target.closest(".cb-node") : null;
      if (!t) { tip.hidden = true; return; }
      showTip(byId.get(t.dataset.id), ev);
    });
    chart.addEventListener("mouseleave", function () { tip.hidden = true; });
    chart.addEventListener("click", function (ev) {
      var t = ev.target.closest ? ev.target.closest(".cb-node") : null;
      if (!t) return;
      var id = t.dataset.id;
      // clicking the zoomed node goes one level up; any other node zooms in on it
      if (id === state.zoom && byId.get(id).p !== null) id = byId.get(id).p;
      tip.hidden = true;
      zoomTo(id);
    });
    function onKey(ev) { if (ev.key === "Escape") zoomTo(data.root); }
    var resizeTimer = null;
    function onResize() {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(renderChart, 100);
    }
    document.addEventListener("keydown", onKey);
    window.addEventListener("resize", onResize);
    render();
    return {
      destroy: function () {
        document.removeEventListener("keydown", onKey);
        window.removeEventListener("resize", onResize);
        container.textContent = "";
      },
      zoom: zoomTo,
      setMode: function (m) { state.mode = m; render(); },
      setScheme: function (s) { state.scheme = s; render(); },
      state: state,
    };
  }

  globalThis.cbtraceIcicle = {mount: mount};
})();
