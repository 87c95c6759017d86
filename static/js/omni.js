/* Omni's pages: one small script, no framework, no CDN (docs/live-ui.md).
   The server renders complete pages; this keeps them current over /ws/live/, draws the
   Plotly charts (Plotly.js is served by the app itself), and asks before any action. */
(function () {
  "use strict";

  // -- small helpers ---------------------------------------------------------------------------
  const $ = (sel, root) => (root || document).querySelector(sel);
  const $$ = (sel, root) => Array.from((root || document).querySelectorAll(sel));
  const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
  const pad = (n) => String(n).padStart(2, "0");
  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    Object.entries(attrs || {}).forEach(([k, v]) => {
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (v !== null && v !== undefined) node.setAttribute(k, v);
    });
    (children || []).forEach((c) => node.append(c));
    return node;
  }
  function humanDuration(seconds) {  // jobs.live_data.human_duration
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "—";
    seconds = Math.floor(seconds);
    const d = Math.floor(seconds / 86400), h = Math.floor((seconds % 86400) / 3600), m = Math.floor((seconds % 3600) / 60);
    if (d) return h ? d + " d " + h + " h" : d + " d";
    if (h) return m ? h + " h " + m + " min" : h + " h";
    return m ? m + " min" : seconds + " s";
  }

  // -- times: the browser's local time, the UTC timestamp on hover --------------------------------
  // The server writes <time datetime="ISO" data-style=... [data-relative="also"|"only"]> with UTC
  // text ({% timestamp %}, jobs/templatetags/omni.py); upgradeTimes rewrites it here, in the
  // same shapes, and relative times are re-rendered every 30 s so a page left open stays true.
  const TIME_STYLES = {
    time: (d) => pad(d.getHours()) + ":" + pad(d.getMinutes()),
    datetime: (d) => MONTHS[d.getMonth()] + " " + d.getDate() + " " + TIME_STYLES.time(d),
    full: (d) => d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " + TIME_STYLES.time(d) + ":" + pad(d.getSeconds()),
  };
  const toDate = (t) => (t instanceof Date ? t : new Date(typeof t === "number" ? t : Date.parse(t)));
  const localTime = (t, style) => (TIME_STYLES[style] || TIME_STYLES.datetime)(toDate(t));
  const utcStamp = (t) => toDate(t).toISOString().slice(0, 19).replace("T", " ") + " UTC";
  function relativeText(t, now) {  // the words of omni.py's relative_time
    const seconds = (toDate(t).getTime() - (now || Date.now())) / 1000;
    if (Math.abs(seconds) < 10) return "just now";
    const span = humanDuration(Math.abs(seconds));
    return seconds > 0 ? "in " + span : span + " ago";
  }
  function renderTime(node, now) {
    const d = toDate(node.getAttribute("datetime"));
    if (isNaN(d.getTime())) return;
    const local = localTime(d, node.dataset.style), mode = node.dataset.relative;
    node.textContent = mode === "only" ? relativeText(d, now) : mode ? local + " (" + relativeText(d, now) + ")" : local;
    node.title = (mode === "only" ? local + " local time · " : "") + utcStamp(d);
  }
  function upgradeTimes(root) { const now = Date.now(); $$("time[datetime]", root).forEach((n) => renderTime(n, now)); }
  function timeEl(t, style, relative) {
    const node = el("time", {datetime: toDate(t).toISOString(), "data-style": style || "datetime", "data-relative": relative || null});
    renderTime(node, Date.now());
    return node;
  }
  // Plotly.js (3.x) draws milliseconds since the epoch in the browser's local time, but an ISO
  // string at its UTC wall-clock time (it drops the offset): every instant a chart shows goes
  // through this, so axes, markers and hover labels all read in local time.
  const plotTime = (t) => toDate(t).getTime();

  // -- an audit row's inputs and outcome as a key/value table ---------------------------------------
  // The rules of facts_table in jobs/templatetags/omni.py: numbers named like times in the range
  // of Unix seconds are instants, units come from the key's suffix, nested objects are sub-rows.
  const TIME_KEY = /(^|_)(at|t|now|since|until|deadline)$|_(s|at|t)$/, ISO_TIME = /^\d{4}-\d\d-\d\dT\d\d:\d\d/;
  const UNITS = [["_ms", " ms"], ["_s", " s"], ["_pct", " %"]];
  const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
  function factValue(key, v) {
    if (v === null || v === undefined || (Array.isArray(v) && !v.length) || (isObject(v) && !Object.keys(v).length)) return "—";
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (typeof v === "number") {
      if (TIME_KEY.test(key) && v >= 1e9 && v < 1e10) return timeEl(v * 1000, "full");
      const unit = UNITS.find(([suffix]) => key.endsWith(suffix));
      return (Number.isInteger(v) ? String(v) : v.toFixed(2).replace(/\.?0+$/, "")) + (unit ? unit[1] : "");
    }
    if (typeof v === "string") return ISO_TIME.test(v) ? timeEl(v, "full") : v;
    if (Array.isArray(v) && v.every((x) => x === null || typeof x !== "object")) {
      const span = el("span");
      v.forEach((x, i) => { if (i) span.append(", "); span.append(factValue(key, x)); });
      return span;
    }
    return JSON.stringify(v);
  }
  function factsTable(facts) {
    if (!isObject(facts) || !Object.keys(facts).length) return el("p", {class: "muted small facts-empty", text: "none recorded"});
    const body = el("tbody");
    const rows = (obj, depth) => Object.keys(obj).sort().forEach((key) => {
      const v = obj[key], group = isObject(v) && Object.keys(v).length > 0;
      body.append(el("tr", {class: "d" + Math.min(depth, 3) + (group ? " group" : "")}, [el("th", {text: key}), el("td", {}, group ? [] : [factValue(key, v)])]));
      if (group) rows(v, depth + 1);
    });
    rows(facts, 0);
    return el("table", {class: "fact-table"}, [body]);
  }
  function csrfToken() {
    const input = $("input[name=csrfmiddlewaretoken]");
    if (input) return input.value;
    const match = document.cookie.match(/(?:^|; )csrftoken=([^;]+)/);
    return match ? decodeURIComponent(match[1]) : "";
  }
  function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }
  function statePill(state, label) { return el("span", {class: "pill state-" + state, text: label || state}); }
  function flash(node) { node.classList.remove("flash"); void node.offsetWidth; node.classList.add("flash"); }

  // -- theme -----------------------------------------------------------------------------------
  function initTheme() {
    const button = $("#theme-toggle");
    if (!button) return;
    button.addEventListener("click", () => {
      const dark = document.documentElement.dataset.theme === "dark" ||
        (!document.documentElement.dataset.theme && matchMedia("(prefers-color-scheme: dark)").matches);
      const next = dark ? "light" : "dark";
      document.documentElement.dataset.theme = next;
      try { localStorage.setItem("omni-theme", next); } catch (e) { /* private mode */ }
      document.dispatchEvent(new CustomEvent("omni:theme"));
    });
  }

  // -- confirmation dialog ------------------------------------------------------------------------
  let dialog = null;
  function confirmDialog(title, text, okLabel, danger) {
    if (!dialog) {
      dialog = el("dialog", {id: "confirm-dialog"}, [
        el("h2", {id: "confirm-title"}), el("p", {id: "confirm-text", class: "muted"}),
        el("div", {class: "buttons"}, [
          el("button", {type: "button", class: "secondary", id: "confirm-cancel", text: "Back"}),
          el("button", {type: "button", id: "confirm-ok", text: "Confirm"}),
        ]),
      ]);
      document.body.append(dialog);
    }
    $("#confirm-title", dialog).textContent = title;
    $("#confirm-text", dialog).textContent = text;
    const ok = $("#confirm-ok", dialog);
    ok.textContent = okLabel || "Confirm";
    ok.className = danger ? "danger" : "";
    return new Promise((resolve) => {
      const done = (answer) => { dialog.close(); ok.onclick = null; $("#confirm-cancel", dialog).onclick = null; resolve(answer); };
      ok.onclick = () => done(true);
      $("#confirm-cancel", dialog).onclick = () => done(false);
      dialog.onclose = () => resolve(false);
      dialog.showModal();
      ok.focus();
    });
  }
  function postTo(url) {
    const form = el("form", {method: "post", action: url}, [el("input", {type: "hidden", name: "csrfmiddlewaretoken", value: csrfToken()})]);
    document.body.append(form);
    form.submit();
  }
  function confirmOnSubmit(form) {  // a form with data-confirm asks first (the page's dialog)
    form.addEventListener("submit", async (event) => {
      if (form.dataset.confirmed) return;
      event.preventDefault();
      const button = $("button[type=submit]", form);
      const danger = button && button.classList.contains("danger");
      if (await confirmDialog(button ? button.textContent : "Confirm", form.dataset.confirm, button ? button.textContent : "Confirm", danger)) {
        form.dataset.confirmed = "1";
        form.submit();
      }
    });
  }
  function initConfirmForms() {
    $$("form[data-confirm]").forEach(confirmOnSubmit);
  }

  // -- the live socket -----------------------------------------------------------------------------
  class LiveSocket {
    constructor() {
      this.subscriptions = [];
      this.handlers = {};
      this.backoffMs = 500;
      this.status = $("#live-status");
      this.connect();
    }
    on(event, handler) { (this.handlers[event] = this.handlers[event] || []).push(handler); return this; }
    subscribe(stream, id) {
      this.subscriptions.push({stream, id});
      if (this.ws && this.ws.readyState === WebSocket.OPEN) this.send({action: "subscribe", stream, id});
      return this;
    }
    send(message) { this.ws.send(JSON.stringify(message)); }
    setStatus(cls, text) { if (this.status) { this.status.hidden = false; this.status.className = "live-dot " + cls; this.status.textContent = text; } }
    connect() {
      const scheme = location.protocol === "https:" ? "wss://" : "ws://";
      this.ws = new WebSocket(scheme + location.host + "/ws/live/");
      this.ws.onopen = () => {
        this.backoffMs = 500;
        this.setStatus("on", "live");
        this.subscriptions.forEach((s) => this.send({action: "subscribe", stream: s.stream, id: s.id}));
      };
      this.ws.onmessage = (message) => {
        const data = JSON.parse(message.data);
        if (data.type === "error") { console.warn("omni live:", data.message); return; }
        if (data.type === "subscribed") {  // tests (and curious people) can see the page is live
          document.body.dataset.liveSubscribed = String(Number(document.body.dataset.liveSubscribed || 0) + 1);
          (this.handlers.subscribed || []).forEach((h) => h(data));
          return;
        }
        if (data.type !== "live") return;
        const payloads = data.batch || [data.payload];
        (this.handlers[data.event] || []).forEach((h) => h(payloads, data));
        (this.handlers["*"] || []).forEach((h) => h(payloads, data));
      };
      this.ws.onclose = (event) => {
        if (event.code === 4401 || event.code === 4403) { this.setStatus("off", "signed out"); return; }
        this.setStatus("off", "reconnecting");
        setTimeout(() => this.connect(), this.backoffMs);
        this.backoffMs = Math.min(this.backoffMs * 2, 15000);
      };
    }
  }

  // -- charts ------------------------------------------------------------------------------------
  const CLASS_COLOURS = () => ({critical: cssVar("--critical"), regular: cssVar("--regular"), best_effort: cssVar("--best_effort")});
  const KIND_COLOURS = {
    preempt: "--failed", kill: "--failed", fail: "--failed", lend: "--borrowed", reclaim: "--borrowed",
    shrink: "--suspect", grow: "--healthy", place: "--healthy", recover: "--healthy", checkpoint: "--accent",
    window_start: "--critical", window_end: "--critical", hold: "--cordoned",
  };
  function baseLayout(extra) {
    const fg = cssVar("--fg"), line = cssVar("--line"), muted = cssVar("--muted");
    return Object.assign({
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
      font: {family: getComputedStyle(document.body).fontFamily, size: 12, color: fg},
      margin: {l: 56, r: 16, t: 44, b: 34}, hovermode: "x unified",
      xaxis: {type: "date", gridcolor: line, linecolor: line, zeroline: false},
      yaxis: {gridcolor: line, linecolor: line, zeroline: false, rangemode: "tozero", title: {font: {color: muted, size: 11}}},
      legend: {orientation: "h", x: 1, xanchor: "right", y: 1.0, yanchor: "bottom", font: {size: 11}},
      showlegend: true,
    }, extra || {});
  }
  const PLOT_CONFIG = {displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"]};
  const NO_DATA = {text: "No data yet", xref: "paper", yref: "paper", x: 0.5, y: 0.5,
    showarrow: false, font: {size: 13, color: "#8a95a3"}, name: "no-data"};
  // A chart without data says so, in a short box with no empty axes around the words.
  const noDataLayout = (layout, text) => Object.assign(layout, {xaxis: {visible: false}, yaxis: {visible: false}, showlegend: false,
    shapes: [], annotations: [Object.assign({}, NO_DATA, text ? {text} : {})], margin: {l: 56, r: 16, t: 30, b: 8}});
  function plotChart(id, traces, layout, hasData, emptyText) {
    const div = document.getElementById(id), resized = div.classList.contains("no-data") === hasData;
    div.classList.toggle("no-data", !hasData);
    Plotly.react(div, traces, hasData ? layout : noDataLayout(layout, emptyText), PLOT_CONFIG);
    if (resized && div._fullLayout) Plotly.Plots.resize(div);  // the box changed height: fill it
  }
  function hasPoints(traces) { return traces.some((t) => t.x && t.x.length); }
  // A time axis spans what the data covers, first to last point, with a small margin.
  function coveredRange(min, max) {
    const margin = Math.max((max - min) * 0.03, 30000);
    return [min - margin, max + margin];
  }
  function markerShapes(markers) {
    return markers.map((m) => ({
      type: "line", xref: "x", yref: "paper", x0: plotTime(m.t), x1: plotTime(m.t), y0: 0, y1: 1,
      line: {color: cssVar(KIND_COLOURS[m.kind] || "--muted"), width: 1.2, dash: m.kind.startsWith("window") ? "dot" : "dash"},
    }));
  }
  function markerAnnotations(markers) {
    return markers.map((m) => ({
      x: plotTime(m.t), xref: "x", y: 1, yref: "paper", yanchor: "bottom", showarrow: false, text: "▼",
      font: {size: 10, color: cssVar(KIND_COLOURS[m.kind] || "--muted")}, hovertext: localTime(m.t, "time") + " " + (m.text || m.label), captureevents: true,
    }));
  }

  // -- dashboard ---------------------------------------------------------------------------------
  function updateJobRow(row, job, event) {
    $("[data-field=state]", row).replaceChildren(statePill(job.state, job.state_label));
    const gpus = $("[data-field=gpus]", row);
    gpus.replaceChildren(document.createTextNode(String(job.gpus)));
    if (job.borrowed_gpus) gpus.append(" ", el("span", {class: "pill borrowed", text: job.borrowed_gpus + " on loan"}));
    // Someone else's job under OMNI_JOB_VISIBILITY=summary: the server sent its summary only.
    if (job.visibility === "summary") { flash(row); return; }
    $("[data-field=layout]", row).textContent = job.dp + " × " + job.accum_steps;
    // The words of a reloaded row (jobs.live_data.waiting_note): "Waiting since 07:21. <why>".
    const waiting = job.waiting;
    setProgress(row, job.committed_steps, waiting && waiting.cannot_fit, Boolean(waiting));
    if (waiting) {
      const lead = el("span", {class: "muted"});
      lead.append(waiting.lead + " ", timeEl(waiting.since, waiting.style), waiting.tail + ".");
      $("[data-field=last]", row).replaceChildren(lead, " ", waiting.reason);
    } else if (event) {
      $("[data-field=last]", row).replaceChildren(timeEl(event.at, "time"), " ", el("span", {text: event.sentence || event.text}));
    }
    flash(row);
  }
  // A row's steps, bar and ETA (remaining steps x the row's measured step time) at ``steps``;
  // for a waiting job that time is its run once it starts, not an ETA.
  function setProgress(row, steps, cannotFit, waiting) {
    const total = Number(row.dataset.total);
    $("[data-field=steps]", row).textContent = steps;
    const bar = $(".bar", row);
    bar.setAttribute("aria-valuenow", String(steps));
    $("span", bar).style.width = (total ? (100 * Math.min(steps, total)) / total : 0).toFixed(1) + "%";
    const eta = $("[data-field=eta]", row);
    if (eta && eta.firstChild) {
      const left = humanDuration(Math.max(0, total - steps) * parseFloat(row.dataset.stepS));
      eta.firstChild.textContent = cannotFit ? "ETA — cannot fit this cluster "
        : waiting ? "run " + left + " once it starts " : "ETA " + left + " ";
    }
  }
  function dashboard() {
    const live = new LiveSocket();
    const rows = {};
    let summaries = false;
    // A job's own stream for rows seen in full; rows only summarised (someone else's job) follow
    // the cluster stream, whose job payloads the server cuts to the summary for this viewer.
    $$("#jobs tr[data-job-id]").forEach((row) => {
      rows[row.dataset.jobId] = row;
      if (row.dataset.detail === "full") live.subscribe("job", Number(row.dataset.jobId));
      else summaries = true;
    });
    live.on("job_event", (payloads) => payloads.forEach((p) => {
      const row = rows[String(p.job.id)];
      if (row) updateJobRow(row, p.job, p.event);
    }));
    // Between audit rows a running job's progress comes with its step records (its stream's
    // telemetry): the newest record's step, as the job page's "steps committed".
    live.on("step_records", (payloads) => payloads.forEach((p) => {
      const row = rows[String(p.job)];
      if (!row || row.dataset.detail !== "full") return;
      let last = null;
      asRecords(p).forEach((r) => {
        if (typeof r.step === "number" && (last === null || recordTime(r) >= recordTime(last))) last = r;
      });
      if (last !== null) setProgress(row, last.step, false);
    }));
    // The header: the cluster's counts, from every cluster summary (docs/live-ui.md).
    live.subscribe("cluster");
    live.on("cluster_summary", (payloads) => {
      const s = payloads[payloads.length - 1];
      const counts = {running: s.jobs.running, waiting: s.jobs.waiting, gpus_allocated: s.gpus_allocated,
                      gpus_total: s.gpus_total, gpus_borrowed: s.gpus_borrowed};
      Object.entries(counts).forEach(([name, value]) => {
        const cell = $(`#dashboard-counts [data-count=${name}]`);
        if (cell.textContent !== String(value)) {
          cell.textContent = String(value);
          flash(cell);
        }
      });
    });
    if (summaries) {
      live.on("job", (payloads) => payloads.forEach((job) => {
        const row = rows[String(job.id)];
        if (row && row.dataset.detail !== "full") updateJobRow(row, job, null);
      }));
    }
  }

  // -- job page ------------------------------------------------------------------------------------
  function asRecords(payload) {
    if (Array.isArray(payload)) return payload;
    for (const key of ["records", "samples", "points", "steps", "gpus"]) if (Array.isArray(payload[key])) return payload[key];
    return [payload];
  }
  // Times on the charts are milliseconds since the epoch (the server sends history that way;
  // telemetry sends Unix seconds).
  const recordTime = (r) => {
    const t = r.at !== undefined ? r.at : r.t;
    return typeof t === "number" ? t * 1000 : Date.parse(t);
  };
  // The Rhythm card (docs/rhythm.md): what was measured, refreshed from the API so it stays true
  // on a page left open (the records arrive every few seconds; a minute-old card would lie).
  function rhythmCard() {
    const card = document.getElementById("rhythm");
    if (!card) return;
    const field = (name) => card.querySelector(`[data-rhythm="${name}"]`);
    const fixed = (x, n) => (x === null || x === undefined ? "" : Number(x).toFixed(n));
    const words = {
      step: (r) => (r.mean_step_s === null ? "" : `${fixed(r.mean_step_s, 3)} s ± ${fixed(r.stdev_step_s, 3)} over the last ${r.samples} steps at dp ${r.dp} (submitted ${card.dataset.submittedS} s)`),
      error: (r) => (r.prediction_error_p50 === null ? "after 10 steps" : `p50 ${fixed(r.prediction_error_p50, 3)}, p95 ${fixed(r.prediction_error_p95, 3)} of a step`)
        + (r.save_prediction_error_p50 === null ? "" : `; saves p50 ${fixed(r.save_prediction_error_p50, 3)}, p95 ${fixed(r.save_prediction_error_p95, 3)}`),
      predictions: (r) => r.words.predictions,
      next_idle: (r) => r.words.next_idle,
      lost: (r) => r.words.lost,
      idle: (r) => (r.idle_phases.length ? r.idle_phases.map((p) => `${p.words} every ${p.every_steps} steps, ${fixed(p.duration_s, 1)} s`).join("; ") : "none seen"),
      diagnosis: (r) => r.diagnosis || "",
      check: (r) => (r.last_check ? r.last_check.text : "no resize or resume yet"),
      stragglers: (r) => (r.stragglers.length ? r.stragglers.map((s) => `rank ${s.rank} on ${s.node || "?"} (${s.slowdown}x)`).join(", ") : "none"),
    };
    async function refresh() {
      try {
        const response = await fetch(card.dataset.apiUrl, {credentials: "same-origin", headers: {Accept: "application/json"}});
        if (!response.ok) return;
        const rhythm = (await response.json()).rhythm;
        if (!rhythm) return;
        field("empty").hidden = true;
        field("facts").hidden = false;
        Object.entries(words).forEach(([name, say]) => { field(name).textContent = say(rhythm); });
      } catch (err) { /* the next tick tries again */ }
    }
    setInterval(refresh, 15000);
  }

  function jobPage(data) {
    rhythmCard();
    const live = new LiveSocket();
    const series = data.series;
    const markers = data.markers.slice();
    const counter = $("#live-points");
    const bump = (n) => { counter.textContent = String(Number(counter.textContent) + n); };
    const MAX_POINTS = 5000;
    const modalities = ["text", "image", "video", "audio"];
    const modalityColours = {text: "#64748b", image: "#0ea5e9", video: "#f59e0b", audio: "#10b981"};

    // GPU traces: one per GPU up to 16, else a heat strip (one row per GPU).
    const gpuNames = [];
    const gpuIndex = {};
    const addGpu = (name, node, gpu) => {
      if (gpuIndex[name] !== undefined) return;
      gpuIndex[name] = gpuNames.length;
      gpuIndex[node + ":" + gpu] = gpuNames.length;
      gpuNames.push(name);
    };
    Object.entries(series.gpus).forEach(([name, t]) => addGpu(name, t.node, t.gpu));
    data.gpu_keys.forEach((k) => addGpu(k.name, k.node, k.gpu));
    const heat = gpuNames.length > 16;

    // Chart times are milliseconds (plotTime). The three charts share one time
    // axis spanning what the data covers, first to last point (the chosen range only bounds what
    // was fetched), and it grows as live points arrive.
    series.step.t = series.step.t.map(plotTime);
    series.tokens.t = series.tokens.t.map(plotTime);
    Object.values(series.gpus).forEach((t) => { t.t = t.t.map(plotTime); });
    const CHARTS = ["chart-step", "chart-gpu", "chart-tokens"];
    const extent = {min: Infinity, max: -Infinity};
    const widen = (xs) => xs.forEach((x) => { extent.min = Math.min(extent.min, x); extent.max = Math.max(extent.max, x); });
    widen(series.step.t);
    Object.values(series.gpus).forEach((t) => widen(t.t));
    const chartSpec = {
      "chart-step": () => ({title: "Step time (s)", yaxis: Object.assign(baseLayout().yaxis, {title: {text: "s / step"}})}),
      "chart-gpu": () => ({title: "GPU utilisation (%)" + (heat ? " · one row per GPU" : ""), showlegend: !heat && gpuNames.length <= 8,
        hovermode: heat ? "closest" : "x unified", margin: {l: 56, r: 16, t: 44, b: heat ? 46 : 34},  // the strip's dates
        yaxis: heat ? {automargin: true, tickfont: {size: 9}} : Object.assign(baseLayout().yaxis, {range: [0, 105], title: {text: "%"}})}),
      "chart-tokens": () => ({title: "Tokens per step, by modality", yaxis: Object.assign(baseLayout().yaxis, {title: {text: "tokens"}})}),
    };
    function chartLayout(id, hasData) {
      const spec = chartSpec[id]();
      const layout = baseLayout(Object.assign(spec, {title: {text: spec.title, font: {size: 13}, x: 0, y: 0.98}}));
      if (!hasData) return layout;
      return Object.assign(layout, {xaxis: Object.assign(baseLayout().xaxis, {range: coveredRange(extent.min, extent.max)}),
        shapes: markerShapes(markers), annotations: id === "chart-step" ? markerAnnotations(markers) : []});
    }
    // What an empty chart says instead of "No data yet": steps came, but they count no tokens.
    const emptyText = {"chart-tokens": series.step.t.length ? "Its step records count no tokens" : ""};
    function redraw(id) {
      const div = document.getElementById(id);
      plotChart(id, div.data, chartLayout(id, hasPoints(div.data)), hasPoints(div.data), emptyText[id]);
    }
    function growRange(xs) {
      widen(xs);
      CHARTS.forEach((id) => {
        const div = document.getElementById(id);
        if (!hasPoints(div.data)) return;
        if (div.layout.xaxis.visible === false) redraw(id);  // its first points: axes and markers appear
        else Plotly.relayout(div, {"xaxis.range": coveredRange(extent.min, extent.max)});
      });
    }
    function drawAll() {
      // Each trace its own x array: Plotly's extendTraces appends to them.
      const stepTraces = [
        {x: series.step.t.slice(), y: series.step.step_s, name: "step time (mean over ranks)", mode: "lines+markers", marker: {size: 3}, line: {color: cssVar("--accent"), width: 1.6}},
        {x: series.step.t.slice(), y: series.step.step_s_max, name: "slowest step of any rank", mode: "lines", line: {color: cssVar("--suspect"), width: 1, dash: "dot"}},
      ];
      plotChart("chart-step", stepTraces, chartLayout("chart-step", hasPoints(stepTraces)), hasPoints(stepTraces));
      drawGpus();
      const tokenTraces = modalities.map((m) => ({
        x: series.tokens.t.slice(), y: series.tokens[m], name: m, stackgroup: "tokens", mode: "lines", line: {width: 0.5, color: modalityColours[m]},
      }));
      plotChart("chart-tokens", tokenTraces, chartLayout("chart-tokens", hasPoints(tokenTraces)), hasPoints(tokenTraces),
                emptyText["chart-tokens"]);
    }
    function drawGpus() {  // the heat strip is redrawn from series as samples arrive
      let gpuTraces;
      if (heat) {
        const times = Array.from(new Set(Object.values(series.gpus).flatMap((t) => t.t))).sort((a, b) => a - b);
        const col = {}; times.forEach((t, i) => { col[t] = i; });
        const z = gpuNames.map((name) => {
          const row = new Array(times.length).fill(null);
          const t = series.gpus[name];
          if (t) t.t.forEach((x, i) => { row[col[x]] = t.util[i]; });
          return row;
        });
        gpuTraces = [{type: "heatmap", x: times, y: gpuNames, z, zmin: 0, zmax: 100, colorscale: "Viridis", colorbar: {title: {text: "%"}, thickness: 10}, hovertemplate: "%{y}<br>%{x}<br>%{z:.0f}%<extra></extra>"}];
      } else {
        gpuTraces = gpuNames.map((name) => {
          const t = series.gpus[name] || {t: [], util: []};
          return {x: t.t.slice(), y: t.util, name, mode: "lines+markers", marker: {size: 2.5}, line: {width: 1.2}};
        });
      }
      plotChart("chart-gpu", gpuTraces, chartLayout("chart-gpu", hasPoints(gpuTraces)), hasPoints(gpuTraces));
    }
    drawAll();
    document.addEventListener("omni:theme", () => {
      // Colours come from CSS variables: redraw with the charts' current data and new colours.
      document.getElementById("chart-step").data[0].line.color = cssVar("--accent");
      CHARTS.forEach(redraw);
    });

    function appendSteps(records) {
      // Ranks report the same step: one point per step, mean and max over ranks.
      const bySteps = new Map();
      records.forEach((r) => {
        const t = plotTime(recordTime(r)), key = r.step !== undefined ? r.step : t;
        const agg = bySteps.get(key) || {t, sum: 0, n: 0, max: 0, step: r.step, tokens: {}, counted: false};
        agg.sum += r.step_s; agg.n += 1; agg.max = Math.max(agg.max, r.step_s);
        if (t > agg.t) agg.t = t;
        modalities.forEach((m) => {
          const n = r["tokens_" + m] || (r.tokens && r.tokens[m]) || 0;
          agg.tokens[m] = (agg.tokens[m] || 0) + n;
          if (n) agg.counted = true;
        });
        bySteps.set(key, agg);
      });
      const points = Array.from(bySteps.values()).sort((a, b) => (a.t < b.t ? -1 : 1));
      if (!points.length) return;
      // Plotly owns the trace arrays: extendTraces appends to them (no copy kept here).
      const xs = points.map((p) => p.t);
      Plotly.extendTraces("chart-step", {x: [xs, xs], y: [points.map((p) => p.sum / p.n), points.map((p) => p.max)]}, [0, 1], MAX_POINTS);
      // Tokens only where the records count them: a plain script's step lines count none.
      const counted = points.filter((p) => p.counted), txs = counted.map((p) => p.t);
      if (counted.length) Plotly.extendTraces("chart-tokens", {x: modalities.map(() => txs), y: modalities.map((m) => counted.map((p) => p.tokens[m] / p.n))}, [0, 1, 2, 3], MAX_POINTS);
      const last = points[points.length - 1];
      if (last.step !== undefined) showSteps(last.step);
      growRange(xs);
      bump(points.length);
    }
    function appendGpus(samples) {
      const perTrace = {};
      samples.forEach((s) => {
        const node = s.node_id !== undefined ? s.node_id : s.node;
        const gpu = s.gpu_index !== undefined ? s.gpu_index : s.gpu;
        const index = gpuIndex[node + ":" + gpu] !== undefined ? gpuIndex[node + ":" + gpu] : gpuIndex[s.name];
        if (index === undefined) return;
        const name = gpuNames[index];
        const t = plotTime(recordTime(s)), util = s.util_pct !== undefined ? s.util_pct : s.util;
        if (heat) {  // the heat strip is redrawn from series; line traces are extended in place
          const trace = series.gpus[name] = series.gpus[name] || {t: [], util: []};
          trace.t.push(t); trace.util.push(util);
        }
        (perTrace[index] = perTrace[index] || {x: [], y: []}).x.push(t);
        perTrace[index].y.push(util);
      });
      const indices = Object.keys(perTrace).map(Number);
      if (!indices.length) return;
      if (heat) drawGpus();
      else Plotly.extendTraces("chart-gpu", {x: indices.map((i) => perTrace[i].x), y: indices.map((i) => perTrace[i].y)}, indices, MAX_POINTS);
      bump(indices.reduce((n, i) => n + perTrace[i].x.length, 0));
      growRange(indices.flatMap((i) => perTrace[i].x));
    }
    live.subscribe("job", data.job_id);
    logsPanel(live);
    ["step_records", "steps"].forEach((name) => live.on(name, (payloads) => appendSteps(payloads.flatMap(asRecords))));
    // telemetry.ingest sends {job, node, node_name, points: [{gpu, at, util_pct, ...}]}.
    ["gpu_samples", "gpu"].forEach((name) => live.on(name, (payloads) => appendGpus(payloads.flatMap(
      (p) => asRecords(p).map((r) => Object.assign({node: p.node, node_name: p.node_name}, r))))));
    live.on("job_event", (payloads) => payloads.forEach((p) => {
      const e = p.event, job = p.job;
      const log = $("#event-log");
      $$(".empty", log).forEach((n) => n.remove());
      const li = el("li", {class: "new", "data-event-id": e.id}, [
        el("span", {class: "when"}, [timeEl(e.at)]),
        el("span", {}, [el("span", {class: "kind kind-" + e.kind, text: e.kind}), " " + (e.sentence || e.text)]),
      ]);
      log.prepend(li);
      markers.push({t: e.at, kind: e.kind, label: e.kind_label, text: e.sentence || e.text});
      CHARTS.forEach(redraw);
      $("#job-state").replaceChildren(statePill(job.state, job.state_label));
      refreshPanels();  // everything else the row changed: the server draws it again
    }));
    // Heartbeats move a running job's last checkpoint and its measured rhythm (the ETA's step
    // time) without an audit row: the panels are fetched again every minute until it has ended.
    setInterval(() => { if (!$("#job-ended")) refreshPanels(); }, 60000);
  }

  // Between audit rows a running job's progress comes with its step records: the count, the bar
  // and the ETA at the step time the page was drawn with (its label says which).
  function showSteps(step) {
    const stat = $("[data-panel=steps]"), total = Number(stat.dataset.total);
    $("#job-steps").textContent = step;
    $("#job-bar").style.width = (total ? (100 * Math.min(step, total)) / total : 0).toFixed(1) + "%";
    const eta = $("#job-eta");
    if (eta && eta.dataset.stepS) $(".num", eta).textContent = humanDuration(Math.max(0, total - step) * parseFloat(eta.dataset.stepS));
  }

  // After each of the job's audit rows, the server's own words for the parts it draws (facts,
  // steps, ETA or how long it took, last checkpoint, why it waits, the cancel button, the
  // workload, checkpoints and GPUs held): the page fetched again without its charts
  // (?panels=1) and each [data-panel] swapped for its new self, so a page left open reads as
  // a reloaded one. The rows of ``wait_ms`` make one fetch, a row during the fetch another;
  // ``then`` gets the fetched document (the Cluster page redraws its Gantt from it).
  let panelsDue = null;
  function refreshPanels(then, wait_ms = 300) {
    if (panelsDue !== null) return;
    panelsDue = setTimeout(async () => {
      panelsDue = null;
      try {
        const url = new URL(location.href);
        url.searchParams.set("panels", "1");
        const response = await fetch(url, {credentials: "same-origin"});
        if (!response.ok) return;
        const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
        $$("[data-panel]").forEach((old) => {
          const now = $(`[data-panel="${old.dataset.panel}"]`, fresh);
          if (!now) return;
          const node = document.importNode(now, true);
          old.replaceWith(node);
          upgradeTimes(node);
          $$("form[data-confirm]", node).forEach(confirmOnSubmit);
        });
        if (then) then(fresh);
      } catch (err) { /* the next row fetches again */ }
    }, wait_ms);
  }

  // The job page's Logs panel (docs/logs.md): the newest lines came with the page; job_logs
  // messages append the new ones (each line once, by id). The rank filter hides the other ranks'
  // lines; the view follows the newest line until the user scrolls up, and again once they
  // scroll back to the bottom (or tick "follow").
  const MAX_LOG_LINES = 5000;  // kept on the page; the API has the whole log
  function logsPanel(live) {
    const box = $("#log-lines");
    if (!box) return;
    const select = $("#log-rank"), follow = $("#log-follow"), empty = $(".empty", box);
    const seen = new Set($$(".log-line", box).map((n) => n.dataset.id));
    const shows = (rank) => select.value === "" || String(rank) === select.value;
    const atBottom = () => box.scrollHeight - box.scrollTop - box.clientHeight < 8;
    const scrollDown = () => { if (follow.checked) box.scrollTop = box.scrollHeight; };
    function showEmpty() {
      const lines = $$(".log-line", box), visible = lines.some((n) => !n.hidden);
      empty.hidden = visible;
      empty.textContent = !lines.length ? "No output yet."
        : "No lines of rank " + select.value + " among the newest ones; the API has the whole log.";
    }
    function filter() {
      $$(".log-line", box).forEach((n) => { n.hidden = !shows(n.dataset.rank); });
      showEmpty();
      scrollDown();
    }
    function offerRank(rank) {
      const options = $$("option", select);
      if (options.some((o) => o.value === String(rank))) return;
      const after = options.find((o) => o.value !== "" && Number(o.value) > rank);
      select.insertBefore(el("option", {value: String(rank), text: "rank " + rank}), after || null);
    }
    select.addEventListener("change", filter);
    follow.addEventListener("change", scrollDown);
    box.addEventListener("scroll", () => { follow.checked = atBottom(); });
    box.scrollTop = box.scrollHeight;
    function addLines(lines) {
      lines.forEach((line) => {
        if (seen.has(String(line.id))) return;
        seen.add(String(line.id));
        offerRank(line.rank);
        const row = el("div", {class: "log-line " + line.stream, "data-id": line.id, "data-rank": line.rank,
          title: (line.node || "") + " · rank " + line.rank + " · std" + line.stream}, [
          el("span", {class: "rank", text: String(line.rank)}), el("span", {class: "text", text: line.text})]);
        row.hidden = !shows(line.rank);
        const rows = $$(".log-line", box), last = rows[rows.length - 1];
        // In id order, whichever way a line came (live, or caught up from the API).
        const next = last && Number(last.dataset.id) > line.id ? rows.find((n) => Number(n.dataset.id) > line.id) : null;
        box.insertBefore(row, next || null);
      });
    }
    // Lines stored between the page's render and the socket's subscription (or while the socket
    // was away) come from the API, from the newest line on the page on.
    async function catchUp() {
      let after = Math.max(0, ...[...seen].map(Number));
      for (let page = 0; page < 20 && box.dataset.logsUrl; page++) {
        const response = await fetch(box.dataset.logsUrl + "?limit=1000&after=" + after, {credentials: "same-origin"});
        if (!response.ok) return;
        const data = await response.json();
        addLines(data.lines);
        trim();
        if (!data.next_after) return;
        after = data.next_after;
      }
    }
    function trim() {
      const rows = $$(".log-line, .log-skipped", box);
      rows.slice(0, Math.max(0, rows.length - MAX_LOG_LINES)).forEach((n) => { seen.delete(n.dataset.id); n.remove(); });
      showEmpty();
      scrollDown();
    }
    live.on("subscribed", () => { catchUp(); });
    live.on("job_logs", (payloads) => {
      payloads.forEach((p) => {
        if (p.skipped) box.append(el("div", {class: "log-skipped muted", text: "… " + p.skipped + " more lines not shown live; reload the page or use the API for them"}));
        addLines(p.lines.map((line) => Object.assign({node: p.node}, line)));
      });
      const rows = $$(".log-line, .log-skipped", box);
      rows.slice(0, Math.max(0, rows.length - MAX_LOG_LINES)).forEach((n) => { seen.delete(n.dataset.id); n.remove(); });
      showEmpty();
      scrollDown();
    });
  }

  // -- console ---------------------------------------------------------------------------------
  const ACTION_TITLES = {cordon: "Cordon", drain: "Drain", uncordon: "Uncordon", repair: "Mark repaired"};
  function consolePage(data, isOperator) {
    const live = new LiveSocket().subscribe("cluster");
    let selected = null;
    function showNode(button) {
      $$(".node.selected").forEach((n) => n.classList.remove("selected"));
      button.classList.add("selected");
      selected = button;
      $("#node-empty").hidden = true;
      const detail = $("#node-detail");
      detail.hidden = false;
      $("[data-f=name]", detail).textContent = button.dataset.nodeName;
      $("[data-f=state]", detail).replaceChildren(el("span", {class: "pill health-" + button.dataset.state, text: button.dataset.stateLabel}));
      const jobs = Array.from(new Set($$(".gpu", button).map((g) => g.dataset.job).filter(Boolean)));
      $("[data-f=jobs]", detail).textContent = jobs.length ? jobs.join(", ") : "none";
      const warning = button.dataset.diskWarning;  // jobs.live_events.disk_note
      $("[data-f=disk]", detail).replaceChildren(...(warning
        ? [el("span", {class: "pill health-failed", text: "low disk"}), " " + warning.replace(/^low disk: /, "")]
        : [button.dataset.disk || "not reported yet"]));
      const allowed = data.node_actions[button.dataset.state] || [];
      $$("[data-action]", detail).forEach((b) => { b.hidden = !allowed.includes(b.dataset.action); });
    }
    $$(".node").forEach((button) => button.addEventListener("click", () => showNode(button)));
    if (isOperator) {
      $$("#node-detail [data-action]").forEach((button) => button.addEventListener("click", async () => {
        if (!selected) return;
        const action = button.dataset.action, name = selected.dataset.nodeName;
        const ok = await confirmDialog(ACTION_TITLES[action] + " " + name + "?", name + ": " + button.dataset.explain +
          " This is recorded in the audit log under your name.", ACTION_TITLES[action], action === "drain");
        if (ok) postTo("/console/nodes/" + selected.dataset.nodeId + "/" + action + "/");
      }));
    }
    const hash = decodeURIComponent(location.hash.slice(1));
    if (hash.startsWith("node-") && $("#" + CSS.escape(hash))) showNode($("#" + CSS.escape(hash)));

    live.on("node", (payloads) => payloads.forEach((node) => {
      const button = $("#node-" + CSS.escape(node.name));
      if (!button) return;
      button.className = "node h-" + node.state + (button === selected ? " selected" : "");
      button.dataset.state = node.state;
      button.dataset.stateLabel = node.state_label;
      const disk = node.disk || {};
      button.dataset.disk = disk.text || "";
      button.dataset.diskWarning = disk.warning || "";
      button.title = node.name + " · " + node.state_label + (node.disk ? " · " + (disk.low ? disk.warning : disk.text + " in its runs dir") : "");
      const nameRow = $(".node-name", button), badge = $(".disk-low", button);
      if (disk.low && !badge) nameRow.append(el("span", {class: "pill health-failed disk-low", style: "font-size: 9.5px; line-height: 13px; padding: 0 5px", text: "low disk"}));
      if (!disk.low && badge) badge.remove();
      const cells = $$(".gpu", button);
      node.gpus.forEach((g, i) => {
        if (!cells[i]) return;
        cells[i].className = "gpu" + (g.priority ? " p-" + g.priority : "") + (g.borrowed ? " borrowed" : "");
        cells[i].dataset.job = g.job || "";
        cells[i].title = "gpu" + g.index + ": " + (g.job ? g.job + (g.borrowed ? " (borrowed)" : "") : (g.held ? "another user's job" : "free"));
      });
      if (button === selected) showNode(button);
    }));

    // The header counts, health and planner pills, planner line, queue and a utilisation point:
    // one cluster_summary after every change (jobs.live_data.cluster_summary), cut for this viewer.
    function queueRow(item) {  // the row templates/jobs/console.html renders
      const name = item.visibility === "summary" ? el("strong", {title: "details are visible to its owner", text: item.name})
        : el("a", {href: "/jobs/" + item.id + "/"}, [el("strong", {text: item.name})]);
      return el("tr", {"data-job-id": item.id}, [
        el("td", {class: "nowrap"}, [name, el("div", {class: "faint small", text: item.owner})]),
        el("td", {}, [el("span", {class: "pill class-" + item.priority, text: item.priority_label})]),
        el("td", {}, [statePill(item.state, item.state_label)]),
        el("td", {class: "num", text: String(item.gpus_wanted)}), el("td", {text: humanDuration(item.waiting_s)}),
        el("td", {class: "wrap", text: item.why || ""}),
      ]);
    }
    function losingRow(item) {  // the row templates/jobs/console.html renders in #losing
      const name = item.visibility === "summary" ? el("strong", {title: "details are visible to its owner", text: item.name})
        : el("a", {href: "/jobs/" + item.id + "/"}, [el("strong", {text: item.name})]);
      return el("tr", {"data-job-id": item.id}, [
        el("td", {class: "nowrap"}, [name, el("div", {class: "faint small", text: item.owner})]),
        el("td", {}, [el("span", {class: "pill class-" + item.priority, text: item.priority_label})]),
        el("td", {class: "num", text: String(item.gpus)}), el("td", {class: "num", text: Number(item.lost_gpus).toFixed(1)}),
        el("td", {class: "wrap", text: item.words}),
      ]);
    }
    function showSummary(s) {
      Object.entries({nodes: s.nodes, gpus_total: s.gpus_total, gpus_allocated: s.gpus_allocated, gpus_borrowed: s.gpus_borrowed})
        .forEach(([name, n]) => { $("#cluster-counts [data-count=" + name + "]").textContent = String(n); });
      const pills = s.health.map((h) => el("span", {class: "pill health-" + h.state, text: h.count + " " + h.state}));
      if (s.planner.paused) pills.push(el("span", {class: "pill health-failed", text: "planner paused"}));
      if (s.planner.dry_run) pills.push(el("span", {class: "pill health-suspect", text: "dry run"}));
      $("#cluster-pills").replaceChildren(...pills);
      const run = s.planner.last_run;  // its relative time keeps ticking with every other <time>
      $("#planner-last").replaceChildren(...(run ? ["last pass ", timeEl(run.started_at, "time", "only"),
        (run.duration_ms ? ", " + Math.round(run.duration_ms) + " ms" : "") + ", " + run.actions + " actions"] : []));
      $("#queue-count").textContent = String(s.queue.length);
      $("#queue tbody").replaceChildren(...(s.queue.length ? s.queue.map(queueRow)
        : [el("tr", {}, [el("td", {colspan: "6", class: "muted", text: "Nothing is waiting."})])]));
      const predictions = s.predictions || [];  // the line templates/jobs/console.html renders in #predictions
      $("#predictions [data-f=predictions]").textContent = predictions.length
        ? predictions.map((p) => `${p.words} p50 ${Number(p.p50).toFixed(3)}, p95 ${Number(p.p95).toFixed(3)} (${p.jobs} job${p.jobs === 1 ? "" : "s"})`).join("; ")
        : "nothing scored yet";
      const losing = s.losing || [];
      $("#losing tbody").replaceChildren(...(losing.length ? losing.map(losingRow)
        : [el("tr", {}, [el("td", {colspan: "5", class: "muted", text: "No running job is losing GPU time (or none has sent 10 step records yet)."})])]));
      const u = data.utilisation;  // allocated and harvested are steps: a point at each summary
      u.t.push(s.at); u.allocated.push(s.gpus_allocated); u.harvested.push(s.gpus_borrowed);
      if (s.used) { u.used_t.push(s.used.t); u.used.push(s.used.gpus); }
      data.gpus_total = s.gpus_total;
      drawUtilisation();
    }
    live.on("cluster_summary", (payloads) => showSummary(payloads[payloads.length - 1]));
    live.on("cluster_summary", (payloads) => teamBars(payloads[payloads.length - 1].teams));  // #team-quotas

    function drawGantt() {
      // One row per reservation (its guaranteed windows), and beneath it one row per loan out of
      // it (borrower, GPUs, until when): horizontal bars from start to end, in local time.
      const rows = [], windows = {base: [], x: [], y: [], hovertext: []}, loans = {base: [], x: [], y: [], hovertext: []};
      const bar = (into, y, start, end, text) => {
        const from = plotTime(start);
        into.base.push(from); into.x.push(plotTime(end) - from); into.y.push(y); into.hovertext.push(text);
      };
      data.gantt.forEach((r) => {
        const y = rows.push(r.name + " · " + r.gpus + " GPUs") - 1;
        r.windows.forEach(([s, e]) => bar(windows, y, s, e, r.name + " (for " + r.job + "): " + r.gpus + " GPUs guaranteed<br>" + localTime(s) + " → " + localTime(e)));
        r.loans.forEach((loan) => {
          const plural = loan.gpus === 1 ? "" : "s";
          const ly = rows.push("↳ " + loan.job + " · " + loan.gpus + " on loan") - 1;
          bar(loans, ly, loan.since, loan.until, loan.job + " borrows " + loan.gpus + " GPU" + plural + " of " + r.name +
            "<br>since " + localTime(loan.since, "time") + ", until " + localTime(loan.until, "time") + " (" + relativeText(loan.until) + ")");
        });
      });
      const traces = [
        Object.assign({type: "bar", orientation: "h", name: "reserved window", marker: {color: cssVar("--critical")}, width: 0.62}, windows),
        Object.assign({type: "bar", orientation: "h", name: "GPUs on loan", marker: {color: cssVar("--borrowed")}, width: 0.5,
          showlegend: loans.y.length > 0}, loans),
      ].map((t) => Object.assign(t, {hovertemplate: "%{hovertext}<extra></extra>"}));
      $("#chart-gantt").style.height = Math.max(140, 76 + 30 * rows.length) + "px";
      const now = plotTime(data.now);
      const layout = baseLayout({
        hovermode: "closest", barmode: "overlay", margin: {l: 200, r: 16, t: 40, b: 44},
        legend: {orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom", font: {size: 11}},
        xaxis: Object.assign(baseLayout().xaxis, {range: [plotTime(data.since), plotTime(data.until)]}),
        yaxis: {tickvals: rows.map((_, i) => i), ticktext: rows, automargin: true, gridcolor: cssVar("--line"), autorange: "reversed", zeroline: false},
        shapes: [{type: "line", xref: "x", yref: "paper", x0: now, x1: now, y0: 0, y1: 1, line: {color: cssVar("--fg"), width: 1, dash: "dot"}}],
        annotations: [{x: now, xref: "x", y: 1, yref: "paper", yanchor: "bottom", text: "now", showarrow: false, font: {size: 10}}],
      });
      plotChart("chart-gantt", traces, layout, rows.length > 0);
    }
    function drawUtilisation() {
      const u = data.utilisation;
      const t = u.t.map(plotTime), usedT = u.used_t.map(plotTime);
      // The walk back through the log starts and ends at synthetic points (24 h ago, now): the data
      // covers from the first change it found (or the first utilisation sample) to now.
      const real = t.slice(1, -1).concat(usedT);
      const start = real.length ? real.reduce((a, b) => Math.min(a, b)) : t[0], end = t[t.length - 1];
      const empty = !real.length && !u.allocated.some((v) => v > 0);
      const layout = baseLayout({xaxis: Object.assign(baseLayout().xaxis, {range: coveredRange(start, end)}),
        yaxis: Object.assign(baseLayout().yaxis, {title: {text: "GPUs"}})});
      plotChart("chart-util", [
        {x: t, y: u.allocated, name: "allocated", mode: "lines", line: {shape: "hv", color: cssVar("--regular"), width: 2}},
        {x: usedT, y: u.used, name: "used (utilisation × GPUs)", mode: "lines", line: {color: cssVar("--healthy"), width: 1.5}},
        {x: t, y: u.harvested, name: "harvested (on loan)", mode: "lines", fill: "tozeroy", line: {shape: "hv", color: cssVar("--borrowed"), width: 1.5}},
        {x: [t[0], end], y: [data.gpus_total, data.gpus_total], name: "capacity", mode: "lines", line: {color: cssVar("--faint"), dash: "dot", width: 1}},
      ], layout, !empty);
    }
    function drawCharts() { drawGantt(); drawUtilisation(); }
    drawCharts();
    document.addEventListener("omni:theme", drawCharts);
    // Reservations and loans as a reload draws them: a job's audit row may start or end a loan,
    // or end the job a reservation is for (its windows stop there), and windows pass with the
    // clock. After job rows (every job's, so at most one fetch in 2 s) and every minute, the page
    // is fetched again without its utilisation history (?panels=1): the table swapped, the Gantt
    // redrawn.
    function refreshReservations() {
      refreshPanels((fresh) => {
        const d = JSON.parse($("#console-data", fresh).textContent);
        Object.assign(data, {gantt: d.gantt, since: d.since, until: d.until, now: d.now});
        drawGantt();
      }, 2000);
    }
    live.on("job", () => refreshReservations());
    setInterval(refreshReservations, 60000);
  }

  // -- teams (docs/teams.md) ---------------------------------------------------------------------
  // The bars templates/jobs/_team_bars.html renders, from jobs.team_data.team_standings rows.
  function teamBar(t) {
    const b = t.bar || {within_pct: 0, borrowed_pct: 0, quota_pct: 0};
    const head = el("div", {class: "team-bar-head"}, [
      el("span", {}, [el("a", {href: "/teams/" + t.id + "/"}, [el("strong", {text: t.name})])].concat(
        t.parent ? [" ", el("span", {class: "faint small", text: "in " + t.parent})] : [])),
      el("span", {class: "num small"}, [el("span", {"data-f": "held", text: String(t.gpus_held)}), " / " + t.quota_gpus + " GPUs"]),
    ]);
    const track = el("div", {class: "tbar", title: t.words}, [
      el("span", {class: "within", style: "width: " + b.within_pct + "%"}),
      el("span", {class: "over", style: "left: " + b.within_pct + "%; width: " + b.borrowed_pct + "%"}),
      el("i", {class: "quota", style: "left: " + b.quota_pct + "%"}),
    ]);
    return el("div", {class: "team-bar", "data-team": t.name}, [head, track, el("div", {class: "faint small", "data-f": "words", text: t.words})]);
  }
  function teamBars(rows) {
    const box = $("#team-bars");
    if (!box || !rows) return;
    box.replaceChildren(...(rows.length ? rows.map(teamBar) : [el("p", {class: "muted", text: "No teams yet."})]));
  }
  function teamsPage() {  // the bars follow each live cluster_summary
    new LiveSocket().subscribe("cluster").on("cluster_summary", (payloads) => teamBars(payloads[payloads.length - 1].teams));
  }
  function teamPage(data) {
    // The standing and the chart follow each live cluster_summary (its teams row); the jobs,
    // members and reservations are re-read from the API every 20 s and redrawn.
    const u = data.usage;
    function draw() {
      const t = u.t.map(plotTime), end = t[t.length - 1];
      const traces = [
        {x: t, y: u.gpus, name: "GPUs held", mode: "lines", fill: "tozeroy", line: {shape: "hv", color: cssVar("--regular"), width: 2}},
        {x: [t[0], end], y: [data.quota_gpus, data.quota_gpus], name: "quota (guaranteed)", mode: "lines", line: {color: cssVar("--fg"), dash: "dot", width: 1.2}},
      ];
      if (data.borrow_limit_gpus !== null && data.borrow_limit_gpus !== undefined) {
        const top = data.quota_gpus + data.borrow_limit_gpus;
        traces.push({x: [t[0], end], y: [top, top], name: "quota + borrowing limit", mode: "lines", line: {color: cssVar("--borrowed"), dash: "dash", width: 1.2}});
      }
      const layout = baseLayout({xaxis: Object.assign(baseLayout().xaxis, {range: [t[0], end]}),
        yaxis: Object.assign(baseLayout().yaxis, {title: {text: "GPUs"}})});
      plotChart("chart-team", traces, layout, true);
    }
    draw();
    document.addEventListener("omni:theme", draw);
    new LiveSocket().subscribe("cluster").on("cluster_summary", (payloads) => {
      const s = payloads[payloads.length - 1], row = (s.teams || []).find((t) => t.id === data.id);
      if (!row) return;
      $("#team-standing").textContent = row.words;
      u.t.push(s.at); u.gpus.push(row.gpus_held);
      draw();
    });
    async function refresh() {
      let detail;
      try {
        const response = await fetch("/api/teams/" + data.id + "/", {headers: {Accept: "application/json"}, credentials: "same-origin"});
        if (!response.ok) return;
        detail = await response.json();
      } catch (e) { return; }
      const withTeam = $("#team-jobs thead th:nth-child(5)") !== null;
      $("#team-jobs tbody").replaceChildren(...(detail.jobs.length ? detail.jobs.map((j) => {
        const name = j.visibility === "full" ? el("a", {href: "/jobs/" + j.id + "/"}, [el("strong", {text: j.name})])
          : el("strong", {title: "details are visible to its owner", text: j.name});
        const gpus = el("td", {class: "num", text: String(j.gpus)});
        if (j.borrowed_gpus) gpus.append(" ", el("span", {class: "pill borrowed", title: "borrowed from a reservation", text: j.borrowed_gpus + " on loan"}));
        return el("tr", {"data-job-id": j.id}, [
          el("td", {class: "nowrap"}, [name, el("div", {class: "faint small", text: j.owner})]),
          el("td", {}, [el("span", {class: "pill class-" + j.priority, text: j.priority_label})]),
          el("td", {}, [statePill(j.state, j.state_label)]), gpus,
        ].concat(withTeam ? [el("td", {text: j.team || ""})] : []));
      }) : [el("tr", {}, [el("td", {colspan: "5", class: "muted", text: "No running or waiting jobs."})])]));
      $("#team-members ul").replaceChildren(...(detail.members.length ? detail.members.map(memberItem)
        : [el("li", {class: "muted", text: "No members."})]));
      // templates/jobs/team_detail.html's rows: a reservation whose job ended leaves the list.
      $("#team-reservations tbody").replaceChildren(...(detail.reservations.length ? detail.reservations.map((r) => el("tr", {}, [
        el("td", {}, [el("strong", {text: r.name})].concat(r.active_now ? [" ", el("span", {class: "pill health-healthy", text: "active"})] : [])),
        el("td", {text: r.team ? "the team's critical jobs" : r.job}),
        el("td", {class: "num", text: r.gpus + (r.spares ? " +" + r.spares : "")}),
        el("td", {text: r.period_s ? humanDuration(r.active_s) + " of every " + humanDuration(r.period_s) : "continuous"}),
      ])) : [el("tr", {}, [el("td", {colspan: "4", class: "muted", text: "No reservations."})])]));
    }
    function memberItem(m) {  // templates/jobs/team_detail.html's row, with an operator's remove button
      const children = [m.user].concat(m.default ? [" ", el("span", {class: "tag", title: "their jobs go here unless they name another team", text: "default team"})] : []);
      if (data.members_url) {
        const form = el("form", {method: "post", action: data.members_url, class: "inline", "data-confirm": "Take " + m.user + " out of team " + data.name + "?"}, [
          el("input", {type: "hidden", name: "csrfmiddlewaretoken", value: csrfToken()}),
          el("input", {type: "hidden", name: "user", value: m.user}), el("input", {type: "hidden", name: "remove", value: "1"}),
          el("button", {type: "submit", class: "link danger", text: "remove"})]);
        confirmOnSubmit(form);
        children.push(" ", form);
      }
      return el("li", {"data-member": m.user}, children);
    }
    setInterval(refresh, 20000);
  }

  // -- audit -----------------------------------------------------------------------------------
  function change(before, after) {  // jobs.views._change: "4 → 2", "→ 8", "4 →", ""
    const none = (v) => v === null || v === undefined;
    if (none(before) && none(after)) return "";
    if (none(before)) return "→ " + after;
    if (none(after)) return before + " →";
    return before === after ? String(before) : before + " → " + after;
  }
  // The hash-chain banner: the server checks each transaction's new rows against their hashes
  // and the row before them (jobs.live_events.chain_check); rows that link to the last one this
  // page verified extend it, in the banner's words (templates/jobs/audit.html). Two senders'
  // messages can cross (docs/live-ui.md, "Out of order"): a check that follows rows this page
  // has not had yet waits for theirs, and only a gap still open after 10 s says so.
  const chainAhead = new Map();  // after_id -> a check that came before the one it follows
  let chainGapDue = null;
  function onChain(c) {
    const banner = $("#chain-status");
    if (!banner) return;
    if (!c.bad && banner.dataset.state === "ok" && c.after_id > Number(banner.dataset.lastId)) {
      chainAhead.set(c.after_id, c);
      clearTimeout(chainGapDue);
      chainGapDue = setTimeout(() => {
        Array.from(chainAhead.keys()).sort((a, b) => a - b).forEach((id) => updateChain(chainAhead.get(id)));
        chainAhead.clear();
      }, 10000);
      return;
    }
    updateChain(c);
    for (let next; (next = chainAhead.get(Number(banner.dataset.lastId)));) {
      chainAhead.delete(next.after_id);
      updateChain(next);
    }
    if (!chainAhead.size) clearTimeout(chainGapDue);  // the gap closed: nothing to say
  }
  function updateChain(c) {
    const banner = $("#chain-status");
    if (!banner || banner.dataset.state === "bad") return;  // a break stays until it is explained
    const lastId = Number(banner.dataset.lastId), checked = Number(banner.dataset.checked);
    const total = Number(banner.dataset.total) + c.rows, linked = c.after_id === lastId;
    const show = (state, icon, title, text) => {
      banner.className = "callout " + state + " chain";
      banner.dataset.state = state;
      banner.replaceChildren(el("span", {class: "icon", text: icon}), el("span", {}, [el("strong", {text: title}), text]));
      flash(banner);
    };
    banner.dataset.total = String(total);
    if (c.bad) {
      show("bad", "✗", "Hash chain broken at row " + c.bad.id, c.bad.problem + ". Rows up to " + (linked ? c.last_good_id : lastId) +
        " verify; nothing after row " + c.bad.id + " can be trusted until it is explained.");
    } else if (banner.dataset.state === "ok" && linked) {
      banner.dataset.lastId = String(c.last_id);
      banner.dataset.checked = String(checked + c.rows);
      show("ok", "✓", "Hash chain verified", "all " + (checked + c.rows) + " rows, up to row " + c.last_id + ", match their hashes and links.");
    } else {
      show("warn", "…", "Verified up to row " + lastId, "(" + checked + " of " + total + " rows); the rest is checked on the next loads.");
    }
  }
  function auditPage(options) {
    const table = $("#audit-table tbody");
    table.addEventListener("click", (event) => {
      const row = event.target.closest("tr.expandable");
      if (!row || event.target.closest("a")) return;
      const detail = row.nextElementSibling;
      detail.hidden = !detail.hidden;
      row.setAttribute("aria-expanded", String(!detail.hidden));
    });
    const live = new LiveSocket().subscribe("audit");
    live.on("chain", (payloads) => payloads.forEach(onChain));
    let unseen = 0;
    live.on("audit", (payloads) => payloads.forEach((e) => {
      if (!options.live) {
        unseen += 1;
        const banner = $("#new-rows");
        banner.hidden = false;
        banner.textContent = unseen + " new row" + (unseen === 1 ? "" : "s") + " since this page loaded; clear the filters or reload to see them.";
        return;
      }
      $$(".empty", table).forEach((n) => n.remove());
      // The same cells and detail as the server's rows (templates/jobs/audit.html, views._change).
      const dash = (v) => (v === null || v === undefined || v === "" ? "—" : String(v));
      const layout = (dp, accum) => (dp === null && accum === null ? null : (dp ?? "·") + "×" + (accum ?? "·"));
      const nodes = (names) => (names && names.length ? names.join(", ") : "—");
      const pair = (label, before, after, cls) => el("tr", {}, [el("th", {text: label}), el("td", {class: cls, text: before}), el("td", {class: cls, text: after})]);
      const row = el("tr", {class: "expandable flash", "data-event-id": e.id, "aria-expanded": "false"}, [
        el("td", {class: "num faint", text: e.id}), el("td", {class: "num", style: "white-space: nowrap"}, [timeEl(e.at, "full")]),
        el("td", {}, [el("span", {class: "kind kind-" + e.kind, text: e.kind})]), el("td", {text: e.job || "—"}),
        el("td", {class: "mono small nowrap", text: (e.nodes_after.length ? e.nodes_after : e.nodes_before).join(", ")}),
        el("td", {text: e.actor}), el("td", {class: "num nowrap", text: change(e.gpus_before, e.gpus_after)}),
        el("td", {class: "num nowrap", text: change(layout(e.dp_before, e.accum_before), layout(e.dp_after, e.accum_after))}),
        el("td", {class: "wrap", text: e.sentence || e.text}),
      ]);
      const hasOutcome = isObject(e.outcome) && Object.keys(e.outcome).length > 0;
      const detail = el("tr", {class: "detail", hidden: ""}, [el("td", {colspan: "9"}, [
        el("div", {class: "grid-2"}, [
          el("div", {}, [el("h3", {text: "Before → after"}), el("table", {class: "beforeafter"}, [
            el("tr", {}, [el("th"), el("th", {text: "before"}), el("th", {text: "after"})]),
            pair("nodes", nodes(e.nodes_before), nodes(e.nodes_after), "mono"), pair("GPUs", dash(e.gpus_before), dash(e.gpus_after)),
            pair("DP", dash(e.dp_before), dash(e.dp_after)), pair("accumulation", dash(e.accum_before), dash(e.accum_after)),
            el("tr", {}, [el("th", {text: "global batch"}), el("td", {colspan: "2", text: dash(e.global_batch)})]),
          ]), el("h3", {text: "Who"}), el("dl", {class: "kv"}, [
            el("dt", {text: "actor"}), el("dd", {text: e.actor}),
            el("dt", {text: "planner run"}), el("dd", {class: "mono"}, [e.planner_run ? el("a", {href: "?planner_run=" + e.planner_run, text: e.planner_run}) : "—"]),
            el("dt", {text: "refers to"}), el("dd", {text: e.refers_to ? "row " + e.refers_to : "—"}),
            el("dt", {text: "hash"}), el("dd", {class: "mono small", text: (e.hash || "").slice(0, 23) + "…"}),
          ])]),
          el("div", {}, [el("h3", {text: "Rule and inputs"}), el("div", {}, [el("span", {class: "kind", text: e.rule || "—"})]),
            factsTable((e.reason || {}).inputs), el("h3", {text: "Outcome"}),
            hasOutcome ? factsTable(e.outcome) : el("p", {class: "muted small", text: "No outcome recorded yet."}),
            el("details", {class: "raw"}, [el("summary", {text: "Raw JSON (reason and outcome as stored)"}),
              el("pre", {text: JSON.stringify({reason: e.reason, outcome: e.outcome}, null, 2)})])]),
        ]),
      ])]);
      // Newest first, by id: a row that arrives after a newer one (two senders' messages can
      // cross) goes below it, where a reload puts it.
      const below = $$("tr[data-event-id]", table).find((r) => Number(r.dataset.eventId) < e.id);
      if (below) below.before(row, detail);
      else table.append(row, detail);
    }));
  }

  // -- the submit form (dashboard) ---------------------------------------------------------------
  // POST /jobs/preview/ (jobs.views.job_submit_preview) runs submit_job's checks without saving,
  // 300 ms after the last keystroke; each field's problems go under it ([data-errors-for]), an
  // empty field's only once the user has touched it, and the job in words below. Signal mode is not elastic: its DP bounds follow dp and cannot be typed.
  function submitForm() {
    const form = $("#submit-form");
    if (!form) return;
    const preview = $("#submit-preview"), touched = new Set();
    $$(".field.invalid", form).forEach((f) => touched.add(f.dataset.fieldName));
    let timer = null, asked = 0;
    function signalMode() {
      const signal = form.elements.integration.value === "signal";
      ["dp_min", "dp_max"].forEach((name) => {
        const input = form.elements[name];
        input.disabled = signal;
        if (signal) input.value = form.elements.dp.value;
      });
      form.elements.grace_s.disabled = !signal;
      $("[data-field-name=grace_s]", form).classList.toggle("off", !signal);
    }
    function showErrors(errors) {
      $$("[data-errors-for]", form).forEach((list) => {
        const name = list.dataset.errorsFor, field = list.closest(".field"), input = form.elements[name];
        // A field not filled in yet says nothing until touched; a rule across fields always speaks.
        const quiet = !touched.has(name) && input && !input.value;
        const problems = quiet ? [] : errors[name] || [];
        list.replaceChildren(...problems.map((text) => el("li", {text})));
        if (field) field.classList.toggle("invalid", problems.length > 0);
      });
    }
    async function check() {
      const mine = ++asked;
      let answer;
      try {
        const response = await fetch(form.dataset.previewUrl, {method: "POST", body: new FormData(form),
          headers: {"X-CSRFToken": csrfToken()}, credentials: "same-origin"});
        if (!response.ok) throw new Error("HTTP " + response.status);
        answer = await response.json();
      } catch (err) {
        if (mine === asked) preview.textContent = "Could not check the form just now (" + err.message + ").";
        return;
      }
      if (mine !== asked) return;  // a later answer is on its way
      showErrors(answer.errors || {});
      preview.textContent = answer.preview || "";
      preview.classList.toggle("bad", $$(".field.invalid", form).length > 0);
    }
    form.addEventListener("input", (event) => {
      if (event.target.name) touched.add(event.target.name);
      if (event.target.name === "integration" || event.target.name === "dp") signalMode();
      clearTimeout(timer);
      timer = setTimeout(check, 300);
    });
    form.addEventListener("submit", () => { $$("[name]", form).forEach((input) => touched.add(input.name)); });
    signalMode();
    check();
  }

  window.Omni = {dashboard, submitForm, jobPage, consolePage, auditPage, confirmDialog, LiveSocket, upgradeTimes,
    teamsPage, teamPage, teamBars};
  initTheme();
  initConfirmForms();
  upgradeTimes(document);
  setInterval(() => { const now = Date.now(); $$("time[datetime][data-relative]").forEach((n) => renderTime(n, now)); }, 30000);
})();
