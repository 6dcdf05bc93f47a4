// moshpit dashboard: polls /api/run.json and draws the page. No library, nothing fetched
// from elsewhere. Every string that comes from a peer (PeerIDs, names, reasons) goes into
// the page through textContent or an attribute value, never as markup.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const COLUMNS = [
    "t", "samples_per_second", "epoch", "peers",
    "loss_median", "loss_p25", "loss_p75", "samples_contributed",
  ];
  const state = { started: null, history: null, limit: 1800, interval: 2, doc: null, renders: 0, lastOk: 0 };

  // ------------------------------------------------------------------ DOM helpers

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "class") node.className = value;
      else node.setAttribute(key, String(value));
    }
    for (const child of children || []) node.appendChild(child);
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function setText(id, text) {
    document.getElementById(id).textContent = text;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  // ------------------------------------------------------------------ formatting

  function num(x, digits) {
    if (x === null || x === undefined) return "–";
    if (Math.abs(x) >= 100 || digits === 0) return Math.round(x).toLocaleString("en-US");
    return x.toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 1 : digits });
  }

  function lossText(x) {
    if (x === null || x === undefined) return "–";
    return Math.abs(x) >= 1000 || (Math.abs(x) < 0.001 && x !== 0) ? x.toExponential(2) : x.toPrecision(4);
  }

  function ago(seconds) {
    if (seconds < 60) return seconds.toFixed(1) + " s ago";
    if (seconds < 3600) return Math.round(seconds / 60) + " min ago";
    return (seconds / 3600).toFixed(1) + " h ago";
  }

  function clock(t) {
    const d = new Date(t * 1000);
    const pad = (n) => String(n).padStart(2, "0");
    return pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }

  // ------------------------------------------------------------------ charts

  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * power >= raw) return m * power;
    return 10 * power;
  }

  function ticks(low, high, count, integer) {
    if (!(high > low)) return [low];
    const step = integer ? Math.max(1, niceStep(high - low, count)) : niceStep(high - low, count);
    const out = [];
    for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-9; v += step) out.push(v);
    return out;
  }

  function range(values, fromZero, integer) {
    let low = Infinity, high = -Infinity;
    for (const v of values) {
      if (v === null || v === undefined) continue;
      if (v < low) low = v;
      if (v > high) high = v;
    }
    if (low === Infinity) return null;
    if (fromZero) low = Math.min(0, low);
    if (high === low) {
      high += integer ? 1 : Math.abs(high) * 0.1 || 1;
      if (!fromZero && !integer) low -= Math.abs(low) * 0.1 || 1;
    }
    const step = integer ? Math.max(1, niceStep(high - low, 4)) : niceStep(high - low, 4);
    return [fromZero ? low : Math.floor(low / step) * step, Math.ceil(high / step) * step];
  }

  // Draws into <svg>: opts = {t, left: {series, fromZero, format}, right: {...}, band}
  // where a series is {values, cls, step}. Returns the number of points drawn.
  function chart(node, opts) {
    clear(node);
    const width = Math.max(300, Math.round(node.getBoundingClientRect().width) || 600);
    const height = Math.max(160, Math.round(node.getBoundingClientRect().height) || 230);
    node.setAttribute("viewBox", "0 0 " + width + " " + height);
    const pad = { left: 58, right: opts.right ? 46 : 14, top: 10, bottom: 24 };
    const w = width - pad.left - pad.right, h = height - pad.top - pad.bottom;
    const t = opts.t;
    if (!t || t.length < 2) {
      node.appendChild(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "placeholder" },
        "waiting for data…"));
      node.dataset.points = "0";
      return 0;
    }
    const t0 = t[0], t1 = t[t.length - 1];
    const x = (v) => pad.left + (w * (v - t0)) / Math.max(1e-9, t1 - t0);
    const axes = {};
    for (const side of ["left", "right"]) {
      const spec = opts[side];
      if (!spec) continue;
      const values = [];
      for (const s of spec.series) values.push(...s.values);
      if (side === "left" && opts.band) values.push(...opts.band.low, ...opts.band.high);
      const r = range(values, spec.fromZero, spec.integer) || [0, 1];
      axes[side] = { r, y: (v) => pad.top + h - (h * (v - r[0])) / Math.max(1e-12, r[1] - r[0]), spec };
    }
    // grid and labels of the left axis, labels of the right one
    const left = axes.left;
    for (const v of ticks(left.r[0], left.r[1], 4, left.spec.integer)) {
      const y = left.y(v);
      node.appendChild(svg("line", { x1: pad.left, x2: pad.left + w, y1: y, y2: y, class: "grid" }));
      node.appendChild(svg("text", { x: pad.left - 6, y: y + 4, "text-anchor": "end" }, left.spec.format(v)));
    }
    if (axes.right) {
      const right = axes.right;
      for (const v of ticks(right.r[0], right.r[1], 4, right.spec.integer)) {
        node.appendChild(svg("text", { x: pad.left + w + 6, y: right.y(v) + 4, "text-anchor": "start" }, right.spec.format(v)));
      }
    }
    node.appendChild(svg("line", { x1: pad.left, x2: pad.left + w, y1: pad.top + h, y2: pad.top + h, class: "axis" }));
    const span = t1 - t0;
    for (let i = 0; i <= 4; i++) {
      const v = t0 + (span * i) / 4;
      const anchor = i === 0 ? "start" : i === 4 ? "end" : "middle";
      node.appendChild(svg("text", { x: x(v), y: height - 6, "text-anchor": anchor }, clock(v)));
    }
    if (opts.band) {
      const { low, high } = opts.band;
      let d = "";
      let run = [];
      const flush = () => {
        if (run.length > 1) {
          d += "M" + run.map((i) => x(t[i]).toFixed(1) + "," + left.y(high[i]).toFixed(1)).join("L");
          d += "L" + run.slice().reverse().map((i) => x(t[i]).toFixed(1) + "," + left.y(low[i]).toFixed(1)).join("L") + "Z";
        }
        run = [];
      };
      for (let i = 0; i < t.length; i++) {
        if (low[i] === null || high[i] === null) flush(); else run.push(i);
      }
      flush();
      if (d) node.appendChild(svg("path", { d, class: "band" }));
    }
    let drawn = 0;
    for (const side of ["right", "left"]) {
      const axis = axes[side];
      if (!axis) continue;
      for (const s of axis.spec.series) {
        let d = "", pen = false, prev = null;
        for (let i = 0; i < t.length; i++) {
          const v = s.values[i];
          if (v === null || v === undefined) { pen = false; continue; }
          const px = x(t[i]).toFixed(1), py = axis.y(v).toFixed(1);
          if (!pen) d += "M" + px + "," + py;
          else if (s.step) d += "H" + px + "V" + py;
          else d += "L" + px + "," + py;
          pen = true; prev = v; drawn += 1;
        }
        if (d) node.appendChild(svg("path", { d, class: "series " + s.cls }));
      }
    }
    node.dataset.points = String(drawn);
    return drawn;
  }

  // ------------------------------------------------------------------ the page

  function mergeHistory(doc) {
    const fresh = state.history === null || doc.started !== state.started;
    if (fresh) {
      state.history = {};
      for (const c of COLUMNS) state.history[c] = [];
      state.started = doc.started;
    }
    const h = state.history;
    const last = h.t.length ? h.t[h.t.length - 1] : -Infinity;
    for (let i = 0; i < doc.history.t.length; i++) {
      if (doc.history.t[i] <= last) continue;
      for (const c of COLUMNS) h[c].push(doc.history[c][i]);
    }
    const extra = h.t.length - state.limit;
    if (extra > 0) for (const c of COLUMNS) h[c].splice(0, extra);
  }

  function renderTiles(doc) {
    setText("run-id", doc.run_id);
    document.title = "moshpit: " + doc.run_id;
    setText("tile-epoch", num(doc.epoch, 0));
    setText("tile-peers", num(doc.num_peers, 0));
    setText("tile-sps", num(doc.samples_per_second));
    setText("tile-samples", num(doc.samples_contributed, 0));
    setText("tile-loss", doc.loss ? lossText(doc.loss.median) : "–");
  }

  function renderStatus(doc) {
    const status = document.getElementById("status");
    const age = doc.time ? Date.now() / 1000 - doc.time : null;
    if (doc.error) {
      status.className = "status error";
      status.textContent = doc.error;
    } else if (doc.time === null) {
      status.className = "status waiting";
      status.textContent = "reading the DHT…";
    } else if (age !== null && age > Math.max(15, 5 * doc.interval)) {
      status.className = "status stale";
      status.textContent = "last read " + ago(age);
    } else {
      status.className = "status live";
      status.textContent = "live · read every " + num(doc.interval, 1) + " s · " + clock(doc.time);
    }
  }

  function peerCell(peerId, short) {
    return el("td", { class: "mono", title: peerId, text: short });
  }

  function nameCell(name) {
    return name === null ? el("td", { class: "name none", text: "–" }) : el("td", { class: "name", title: name, text: name });
  }

  function renderPeers(doc) {
    const body = document.querySelector("#peers tbody");
    clear(body);
    for (const p of doc.peers) {
      const sps = el("td", { class: "num" }, [document.createTextNode(num(p.samples_per_second))]);
      if (p.clamped) {
        sps.appendChild(el("span", {
          class: "badge", text: "clamped",
          title: "claims " + num(p.claimed_samples_per_second) + " samples/s",
        }));
      }
      const donor = p.donor ? "yes (epoch " + p.donor_epoch + ")" : "no";
      const row = el("tr", { "data-peer": p.peer_id, class: p.age_seconds > 3 * Math.max(2, doc.interval) + 10 ? "quiet" : null }, [
        peerCell(p.peer_id, p.short),
        nameCell(p.name),
        el("td", { class: "num", text: num(p.epoch, 0) }),
        sps,
        el("td", { class: "num", text: lossText(p.loss) }),
        el("td", { class: "num", text: ago(p.age_seconds) }),
        el("td", { class: p.role === null ? "none" : null, text: p.role === null ? "unknown" : p.role }),
        el("td", { class: p.donor ? null : "none", text: donor }),
        el("td", { class: p.problem ? "bad" : null, text: p.problem || "ok" }),
        el("td", { class: "num", text: num(p.contributed, 0) }),
      ]);
      body.appendChild(row);
    }
    const more = doc.peers_truncated ? " (first " + doc.peers.length + " listed)" : "";
    setText("peers-count", doc.num_peers + more);
    document.getElementById("peers-empty").hidden = doc.peers.length > 0;
  }

  function renderBoard(doc) {
    const body = document.querySelector("#board tbody");
    clear(body);
    const total = doc.samples_contributed || 0;
    const top = doc.contributions.length ? doc.contributions[0].samples : 0;
    doc.contributions.forEach((c, i) => {
      const bar = el("div", { class: c.live ? "bar" : "bar gone" });
      bar.style.width = (top > 0 ? (100 * c.samples) / top : 0).toFixed(1) + "%";
      const share = total > 0 ? ((100 * c.samples) / total).toFixed(1) + "%" : "–";
      body.appendChild(el("tr", { "data-peer": c.peer_id, class: c.live ? null : "quiet" }, [
        el("td", { class: "num", text: i + 1 }),
        nameCell(c.name),
        peerCell(c.peer_id, c.short),
        el("td", { class: "num", text: num(c.samples, 0) }),
        el("td", { title: share }, [bar]),
      ]));
    });
    setText("board-count", doc.num_contributors ? String(doc.num_contributors) : "");
  }

  function renderNotes(doc) {
    const list = document.getElementById("notes");
    clear(list);
    const entries = Object.entries(doc.notes || {});
    for (const [peer, reason] of entries) {
      list.appendChild(el("li", { title: peer, text: peer.slice(-6) + ": " + reason }));
    }
    document.getElementById("notes-card").hidden = entries.length === 0;
  }

  function renderCharts() {
    const h = state.history;
    const drawn = chart(document.getElementById("chart-throughput"), {
      t: h.t,
      left: { series: [{ values: h.samples_per_second, cls: "sps" }], fromZero: true, format: (v) => num(v) },
      right: { series: [{ values: h.epoch, cls: "epoch", step: true }], fromZero: false, integer: true, format: (v) => num(v, 0) },
    });
    chart(document.getElementById("chart-loss"), {
      t: h.t,
      left: { series: [{ values: h.loss_median, cls: "loss" }], fromZero: false, format: (v) => String(Number(v.toPrecision(3))) },
      band: { low: h.loss_p25, high: h.loss_p75 },
    });
    return drawn;
  }

  function render(doc) {
    renderTiles(doc);
    renderStatus(doc);
    renderPeers(doc);
    renderBoard(doc);
    renderNotes(doc);
    renderCharts();
    state.renders += 1;
    document.body.dataset.renders = String(state.renders);
    if (state.renders === 1) {
      // when the first full render ended (for benchmarks and tests)
      document.body.dataset.firstRenderMs = String(Math.round(performance.now()));
    }
  }

  async function fetchRun() {
    const since = state.history && state.history.t.length ? state.history.t[state.history.t.length - 1] : null;
    const url = "/api/run.json" + (since === null ? "" : "?since=" + encodeURIComponent(since));
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), Math.max(5000, 3000 * state.interval));
    try {
      const response = await fetch(url, { cache: "no-store", signal: abort.signal });
      if (!response.ok) throw new Error("HTTP " + response.status);
      return await response.json();
    } finally {
      clearTimeout(timer);
    }
  }

  async function poll() {
    try {
      const doc = await fetchRun();
      state.interval = Math.min(60, Math.max(0.5, Number(doc.interval) || 2));
      state.limit = Math.max(1, Number(doc.history_limit) || 1800);
      if (state.started !== null && doc.started !== state.started) {
        state.history = null; // the dashboard restarted: its history is new
        state.doc = null;
        setTimeout(poll, 0);
        return;
      }
      mergeHistory(doc);
      state.doc = doc;
      state.lastOk = Date.now();
      render(doc);
    } catch (e) {
      const status = document.getElementById("status");
      status.className = "status error";
      status.textContent = "the dashboard does not answer (" + (e && e.message ? e.message : "error") + "); retrying";
    }
    setTimeout(poll, state.interval * 1000);
  }

  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { if (state.history) renderCharts(); }, 150);
  });

  poll();
})();
