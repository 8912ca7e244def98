// BackpressureChart and LifecycleTimeline in the browser: uPlot on a canvas sized to the
// device pixel ratio (crisp at any width), fed by the kernel's incremental messages
// (sandboxkit/notebook/charts.py decides what to send; this module only draws).
//
// Backpressure:  {type: "sample", t, lags: {cid: bytes}, states: {cid: state}, labels?}
//                {type: "restart", t, old, pid}
//                {type: "snapshot", view, pid, window, now, labels, points, restarts}
// Timeline:      {type: "events" | "snapshot", now, markers, pauses, stalls}
// To the kernel: {type: "hello", view}  (a (re)rendered view asks for a snapshot)

// Each consumer state's colour, and which states are final, come from the kernel (the
// widget's `state_colors` and `final_states`: sandboxkit/vocab.py's STATE_COLORS and
// FINAL_CONSUMER_STATES); a state without a colour is drawn in UNKNOWN_STATE.
const UNKNOWN_STATE = "#1f77b4";
const ROWS = ["stalls", "consumers", "processes", "paused"];

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  return e;
}

function fmtBytes(v) {
  if (v == null) return "";
  if (Math.abs(v) >= 1048576) return (v / 1048576).toFixed(1) + " MB";
  if (Math.abs(v) >= 1024) return (v / 1024).toFixed(0) + " kB";
  return v.toFixed(0) + " B";
}

// The kernel's clock (seconds since the chart started), estimated between messages.
function kernelClock() {
  let base = 0, at = performance.now();
  return {
    set(t) { base = t; at = performance.now(); },
    now() { return base + (performance.now() - at) / 1000; },
  };
}

// Lines drawn later are thinner, so a line lying on an earlier one leaves that one's colour
// showing along both its edges; a ghost's line is dashed as well.
const LINE_WIDTHS = [4, 2.5, 1.5];
const GHOST_DASH = [6, 4];
const STRIP = 5; // CSS px: one consumer's state strip, above the plot area
const STRIP_GAP = 1;

function isGhost(label) { return /^ghost\b/.test(label); }

function backpressure(uPlot, root, model, height, widthOf) {
  const stateColor = (st) => (model.get("state_colors") || {})[st] || UNKNOWN_STATE;
  const isFinal = (st) => (model.get("final_states") || []).includes(st);
  const clock = kernelClock();
  let window_ = 120;
  let samples = []; // [{t, lags, states}]
  const labels = new Map(); // cid -> {label, color}
  const lastState = new Map();
  let restarts = []; // [t, old, pid]

  const legend = el("div", "sandboxkit-chart-legend");
  const plotBox = el("div", "sandboxkit-chart-plot");
  root.append(plotBox, legend);

  let plot = null;
  let order = [];

  function build() {
    order = [...labels.keys()];
    const series = [{}].concat(order.map((cid, i) => ({
      label: labels.get(cid).label,
      stroke: labels.get(cid).color,
      width: LINE_WIDTHS[Math.min(i, LINE_WIDTHS.length - 1)],
      dash: isGhost(labels.get(cid).label) ? GHOST_DASH : undefined,
      paths: uPlot.paths.stepped({ align: 1 }),
      points: { show: false },
      spanGaps: false,
      value: (u, v) => fmtBytes(v),
    })));
    if (plot) plot.destroy();
    plot = new uPlot({
      width: widthOf(),
      height,
      series,
      // The state strips get a band of their own above the plot area: inside it they
      // would read as lag values.
      padding: [order.length * (STRIP + STRIP_GAP) + 6, null, null, null],
      legend: { show: false },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: false }, y: { range: (u, lo, hi) => [0, Math.max(1024, hi * 1.25)] } },
      axes: [
        { label: "seconds", size: 36, labelSize: 14 },
        { label: "lag", size: 64, labelSize: 14, values: (u, vals) => vals.map(fmtBytes) },
      ],
      hooks: { draw: [drawOverlay] },
    }, data(), plotBox);
  }

  function data() {
    const now = clock.now();
    const lo = now - window_;
    const xs = [], ys = order.map(() => []);
    for (const s of samples) {
      if (s.t < lo) continue;
      xs.push(s.t);
      order.forEach((cid, i) => ys[i].push(cid in s.lags ? s.lags[cid] : null));
    }
    xs.push(Math.max(now, xs.length ? xs[xs.length - 1] : 0));
    order.forEach((cid, i) => {
      const st = lastState.get(cid);
      const open = st && !isFinal(st);
      const last = ys[i].length ? ys[i][ys[i].length - 1] : null;
      ys[i].push(open ? last : null); // an open consumer's line reaches "now"; a closed one stops
    });
    if (xs.length === 1) xs.unshift(Math.max(0, now - 1)), ys.forEach((y) => y.unshift(null));
    return [xs, ...ys];
  }

  // State strips in the band above the plot area (state colours), restart marks.
  function drawOverlay(u) {
    const ctx = u.ctx;
    const { left, top, width, height: h } = u.bbox;
    const px = devicePixelRatio || 1;
    const strip = STRIP * px;
    const band = top - 3 * px - order.length * (strip + STRIP_GAP * px);
    ctx.save();
    if (order.length) {
      ctx.fillStyle = "#666";
      ctx.font = `${10 * px}px sans-serif`;
      ctx.textAlign = "right";
      ctx.textBaseline = "top";
      ctx.fillText("state", left - 4 * px, band - px);
      ctx.textAlign = "left";
      ctx.textBaseline = "alphabetic";
    }
    order.forEach((cid, i) => {
      let prev = null;
      const y = band + i * (strip + STRIP_GAP * px);
      for (const s of samples.concat([{ t: clock.now(), states: {} }])) {
        if (prev && prev.states[cid]) {
          const x0 = Math.max(left, u.valToPos(prev.t, "x", true));
          const x1 = Math.min(left + width, u.valToPos(s.t, "x", true));
          if (x1 > x0) {
            ctx.fillStyle = stateColor(prev.states[cid]);
            ctx.fillRect(x0, y, x1 - x0, strip);
          }
        }
        prev = s;
      }
    });
    ctx.strokeStyle = "#444";
    ctx.fillStyle = "#444";
    ctx.setLineDash([4 * px, 3 * px]);
    ctx.font = `${11 * px}px sans-serif`;
    for (const [t, , pid] of restarts) {
      const x = u.valToPos(t, "x", true);
      if (x < left || x > left + width) continue;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + h);
      ctx.stroke();
      ctx.fillText(`restart → pid ${pid}`, x + 4 * px, top + 12 * px);
    }
    ctx.restore();
  }

  function renderLegend() {
    legend.replaceChildren();
    for (const cid of order) {
      const item = el("span", "sandboxkit-chart-item");
      const sw = el("span", "sandboxkit-chart-swatch");
      sw.style.color = labels.get(cid).color;
      sw.classList.toggle("sandboxkit-chart-dashed", isGhost(labels.get(cid).label));
      const st = lastState.get(cid) || "streaming";
      const badge = el("span", "sandboxkit-chart-state", st);
      badge.style.background = stateColor(st);
      badge.dataset.state = st;
      item.append(sw, el("span", "sandboxkit-chart-label", labels.get(cid).label), badge);
      item.dataset.consumer = cid;
      legend.append(item);
    }
    if (!order.length) legend.append(el("span", "sandboxkit-chart-empty", "no consumers yet"));
  }

  function redraw(rebuild) {
    if (rebuild || !plot) build();
    else plot.setData(data());
    renderLegend();
  }

  function trim() {
    const lo = clock.now() - window_;
    while (samples.length > 1 && samples[1].t < lo) samples.shift();
    if (samples.length > 5000) samples = samples.slice(-5000);
  }

  return {
    message(msg) {
      if (msg.type === "snapshot") {
        window_ = msg.window;
        clock.set(msg.now);
        labels.clear();
        lastState.clear();
        samples = [];
        restarts = msg.restarts || [];
        const byT = new Map();
        for (const [cid, info] of Object.entries(msg.labels)) labels.set(cid, info);
        for (const [cid, pts] of Object.entries(msg.points)) {
          for (const [t, lag, st] of pts) {
            if (!byT.has(t)) byT.set(t, { t, lags: {}, states: {} });
            byT.get(t).lags[cid] = lag;
            byT.get(t).states[cid] = st;
            lastState.set(cid, st);
          }
        }
        samples = [...byT.values()].sort((a, b) => a.t - b.t);
        redraw(true);
      } else if (msg.type === "sample") {
        clock.set(msg.t);
        let rebuild = false;
        if (msg.labels) {
          for (const [cid, info] of Object.entries(msg.labels)) labels.set(cid, info);
          rebuild = true;
        }
        for (const [cid, st] of Object.entries(msg.states)) lastState.set(cid, st);
        samples.push({ t: msg.t, lags: msg.lags, states: msg.states });
        trim();
        redraw(rebuild);
      } else if (msg.type === "restart") {
        clock.set(msg.t);
        restarts.push([msg.t, msg.old, msg.pid]);
        // The old process's consumers stop where they were; the new ones follow.
        for (const cid of labels.keys()) lastState.set(cid, "closed");
        redraw(false);
      }
    },
    tick() { if (plot) plot.setData(data()); },
    resize(w) { if (plot && plot.width !== w) plot.setSize({ width: w, height }); },
    destroy() { if (plot) plot.destroy(); },
  };
}

function timeline(uPlot, root, model, height, widthOf) {
  let state = { now: 0, markers: [], pauses: [], stalls: [] };
  let at = performance.now();
  const plotBox = el("div", "sandboxkit-chart-plot");
  const legend = el("div", "sandboxkit-chart-legend");
  root.append(plotBox, legend);
  const now = () => state.now + (performance.now() - at) / 1000;

  function data() { return [[0, Math.max(1, now())], [null, null]]; }

  function drawAll(u) {
    const ctx = u.ctx;
    const { left, top, width, height: h } = u.bbox;
    const px = devicePixelRatio || 1;
    const band = (row) => [u.valToPos(row + 0.35, "y", true), u.valToPos(row - 0.35, "y", true)];
    const xs = (t) => Math.min(left + width, Math.max(left, u.valToPos(t, "x", true)));
    ctx.save();
    const [py0, py1] = band(3);
    ctx.fillStyle = "#bbbbbb";
    for (const [a, b] of state.pauses) {
      const x0 = xs(a), x1 = xs(b == null ? now() : b);
      ctx.fillRect(x0, py0, Math.max(px, x1 - x0), py1 - py0);
    }
    const [sy0, sy1] = band(0);
    ctx.fillStyle = "rgba(214, 39, 40, 0.6)";
    for (const [a, b] of state.stalls) {
      const x0 = xs(a), x1 = xs(b);
      ctx.fillRect(x0, sy0, Math.max(px, x1 - x0), sy1 - sy0);
    }
    for (const [t, row, , color] of state.markers) {
      ctx.fillStyle = color;
      ctx.beginPath();
      ctx.arc(xs(t), u.valToPos(row, "y", true), 4 * px, 0, 2 * Math.PI);
      ctx.fill();
    }
    ctx.restore();
  }

  const plot = new uPlot({
    width: widthOf(),
    height,
    series: [{}, { show: false }],
    legend: { show: false },
    cursor: { show: false },
    scales: { x: { time: false }, y: { range: [-0.6, 3.6] } },
    axes: [
      { label: "seconds since the first event", size: 36, labelSize: 14 },
      { size: 84, splits: () => [0, 1, 2, 3], values: (u, vals) => vals.map((v) => ROWS[v]) },
    ],
    hooks: { draw: [drawAll] },
  }, data(), plotBox);

  function renderLegend() {
    legend.replaceChildren();
    const seen = new Map();
    for (const [, , label, color] of state.markers) seen.set(label, color);
    for (const [label, color] of seen) {
      const item = el("span", "sandboxkit-chart-item");
      const sw = el("span", "sandboxkit-chart-dot");
      sw.style.background = color;
      item.append(sw, el("span", "sandboxkit-chart-label", label));
      legend.append(item);
    }
  }

  return {
    message(msg) {
      if (msg.type === "events" || msg.type === "snapshot") {
        state = msg;
        at = performance.now();
        plot.setData(data());
        renderLegend();
      }
    },
    tick() { plot.setData(data()); },
    resize(w) { if (plot.width !== w) plot.setSize({ width: w, height }); },
    destroy() { plot.destroy(); },
  };
}

async function render({ model, el: root }) {
  const { default: uPlot } = await vendor(model, "uplot");
  const view = Math.random().toString(36).slice(2);
  root.classList.add("sandboxkit-chart-root");
  const title = el("div", "sandboxkit-chart-title", model.get("title"));
  root.append(title);
  const onTitle = () => { title.textContent = model.get("title"); };
  model.on("change:title", onTitle);
  // A view can render, or rebuild its plot, while hidden (a background tab, a collapsed
  // output): its box is 0 wide then. It takes the last width it was shown at (600 px
  // if never), and the ResizeObserver below sets the real one once it shows.
  let lastWidth = 0;
  const widthOf = () => {
    if (root.clientWidth > 0) lastWidth = root.clientWidth;
    return Math.max(200, lastWidth || 600);
  };
  const make = model.get("kind") === "timeline" ? timeline : backpressure;
  const chart = make(uPlot, root, model, model.get("height"), widthOf);
  let synced = false;
  const onMessage = (msg) => {
    if (msg.type === "snapshot") {
      if (msg.view !== view) return;
      synced = true;
    } else if (!synced) {
      return;
    }
    chart.message(msg);
  };
  model.on("msg:custom", onMessage);
  const timer = setInterval(() => chart.tick(), 1000); // the time axis moves on by itself
  const resize = new ResizeObserver(() => {
    if (root.clientWidth > 0) chart.resize(widthOf());
  });
  resize.observe(root);
  model.send({ type: "hello", view });
  return () => {
    model.off("msg:custom", onMessage);
    model.off("change:title", onTitle);
    clearInterval(timer);
    resize.disconnect();
    chart.destroy();
  };
}

export default { render };
