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
  function fmtTime(iso, withDate) {
    const d = new Date(iso);
    const hm = pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes());
    return withDate === false ? hm : MONTHS[d.getUTCMonth()] + " " + d.getUTCDate() + " " + hm;
  }
  function fmtFull(iso) {
    const d = new Date(iso);
    return d.getUTCFullYear() + "-" + pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate()) + " " +
      pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes()) + ":" + pad(d.getUTCSeconds());
  }
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
  function humanDuration(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "—";
    seconds = Math.round(seconds);
    const d = Math.floor(seconds / 86400), h = Math.floor((seconds % 86400) / 3600), m = Math.floor((seconds % 3600) / 60);
    if (d) return d + " d " + h + " h";
    if (h) return h + " h " + m + " min";
    return m ? m + " min" : seconds + " s";
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
  function initConfirmForms() {
    $$("form[data-confirm]").forEach((form) => {
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
    });
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
  const NO_DATA = {text: "No samples in this range yet", xref: "paper", yref: "paper", x: 0.5, y: 0.5,
    showarrow: false, font: {size: 13, color: "#8a95a3"}, name: "no-data"};
  function hasPoints(traces) { return traces.some((t) => (t.x && t.x.length) || (t.z && t.z.length)); }
  function markerShapes(markers) {
    return markers.map((m) => ({
      type: "line", xref: "x", yref: "paper", x0: m.t, x1: m.t, y0: 0, y1: 1,
      line: {color: cssVar(KIND_COLOURS[m.kind] || "--muted"), width: 1.2, dash: m.kind.startsWith("window") ? "dot" : "dash"},
    }));
  }
  function markerAnnotations(markers) {
    return markers.map((m) => ({
      x: m.t, xref: "x", y: 1, yref: "paper", yanchor: "bottom", showarrow: false, text: "▼",
      font: {size: 10, color: cssVar(KIND_COLOURS[m.kind] || "--muted")}, hovertext: m.text || m.label, captureevents: true,
    }));
  }

  // -- dashboard ---------------------------------------------------------------------------------
  function updateJobRow(row, job, sentence) {
    $("[data-field=state]", row).replaceChildren(statePill(job.state, job.state_label));
    const gpus = $("[data-field=gpus]", row);
    gpus.replaceChildren(document.createTextNode(String(job.gpus)));
    if (job.borrowed_gpus) gpus.append(" ", el("span", {class: "pill borrowed", text: job.borrowed_gpus + " on loan"}));
    // Someone else's job under OMNI_JOB_VISIBILITY=summary: the server sent its summary only.
    if (job.visibility === "summary") { flash(row); return; }
    $("[data-field=layout]", row).textContent = job.dp + " × " + job.accum_steps;
    $("[data-field=steps]", row).textContent = job.committed_steps;
    $(".bar > span", row).style.width = (100 * job.progress).toFixed(1) + "%";
    const stepS = parseFloat(row.dataset.stepS);
    const eta = $("[data-field=eta]", row);
    if (eta && eta.firstChild) eta.firstChild.textContent = "ETA " + humanDuration(job.remaining_steps * stepS) + " ";
    if (["pending", "preempted"].includes(job.state) && job.pending_reason) {
      $("[data-field=last]", row).replaceChildren(el("span", {class: "muted", text: "Waiting: "}), job.pending_reason);
    } else if (sentence) {
      $("[data-field=last]", row).replaceChildren(el("span", {text: sentence}));
    }
    flash(row);
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
      if (row) updateJobRow(row, p.job, p.event.text);
    }));
    if (summaries) {
      live.subscribe("cluster");
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
  function jobPage(data) {
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

    // Every chart spans the chosen range and grows to the newest live point.
    let rangeEnd = data.until;
    const xaxis = () => Object.assign(baseLayout().xaxis, {range: [data.since, rangeEnd]});
    function clearNoData(id) {
      const div = document.getElementById(id);
      const notes = (div.layout.annotations || []).filter((a) => a.name !== "no-data");
      if (notes.length !== (div.layout.annotations || []).length) Plotly.relayout(id, {annotations: notes});
    }
    function growRange(newest) {
      if (!newest || new Date(newest) <= new Date(rangeEnd)) return;
      rangeEnd = newest;
      ["chart-step", "chart-gpu", "chart-tokens"].forEach((id) => Plotly.relayout(id, {"xaxis.range": [data.since, rangeEnd]}));
    }
    function drawAll() {
      const shapes = markerShapes(markers), annotations = markerAnnotations(markers);
      const stepTraces = [
        {x: series.step.t, y: series.step.step_s, name: "step time (mean over ranks)", mode: "lines+markers", marker: {size: 3}, line: {color: cssVar("--accent"), width: 1.6}},
        {x: series.step.t, y: series.step.step_s_max, name: "slowest rank", mode: "lines", line: {color: cssVar("--suspect"), width: 1, dash: "dot"}},
      ];
      Plotly.react("chart-step", stepTraces, baseLayout({title: {text: "Step time (s)", font: {size: 13}, x: 0, y: 0.98}, shapes, xaxis: xaxis(),
        annotations: annotations.concat(hasPoints(stepTraces) ? [] : [NO_DATA]),
        yaxis: Object.assign(baseLayout().yaxis, {title: {text: "s / step"}})}), PLOT_CONFIG);
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
          return {x: t.t, y: t.util, name, mode: "lines+markers", marker: {size: 2.5}, line: {width: 1.2}};
        });
      }
      Plotly.react("chart-gpu", gpuTraces, baseLayout({title: {text: "GPU utilisation (%)" + (heat ? " · one row per GPU" : ""), font: {size: 13}, x: 0, y: 0.98}, xaxis: xaxis(),
        annotations: hasPoints(gpuTraces) ? [] : [NO_DATA],
        shapes, showlegend: !heat && gpuNames.length <= 8, hovermode: heat ? "closest" : "x unified",
        yaxis: heat ? {automargin: true, tickfont: {size: 9}} : Object.assign(baseLayout().yaxis, {range: [0, 105], title: {text: "%"}})}), PLOT_CONFIG);
      const tokenTraces = modalities.map((m) => ({
        x: series.tokens.t, y: series.tokens[m], name: m, stackgroup: "tokens", mode: "lines", line: {width: 0.5, color: modalityColours[m]},
      }));
      Plotly.react("chart-tokens", tokenTraces, baseLayout({title: {text: "Tokens per step, by modality", font: {size: 13}, x: 0, y: 0.98}, shapes, xaxis: xaxis(),
        annotations: hasPoints(tokenTraces) ? [] : [NO_DATA],
        yaxis: Object.assign(baseLayout().yaxis, {title: {text: "tokens"}})}), PLOT_CONFIG);
    }
    drawAll();
    document.addEventListener("omni:theme", () => {
      // Colours come from CSS variables: redraw with the charts' current data and new colours.
      const shapes = markerShapes(markers);
      ["chart-step", "chart-gpu", "chart-tokens"].forEach((id) => {
        const div = document.getElementById(id);
        const layout = baseLayout({title: div.layout.title, shapes, showlegend: div.layout.showlegend, hovermode: div.layout.hovermode, xaxis: xaxis(),
          yaxis: Object.assign(baseLayout().yaxis, {range: div.layout.yaxis.range, title: div.layout.yaxis.title, type: div.layout.yaxis.type})});
        if (id === "chart-step") layout.annotations = markerAnnotations(markers);
        if (id === "chart-step") div.data[0].line.color = cssVar("--accent");
        Plotly.react(div, div.data, layout, PLOT_CONFIG);
      });
    });

    function appendSteps(records) {
      // Ranks report the same step: one point per step, mean and max over ranks.
      const bySteps = new Map();
      records.forEach((r) => {
        const key = r.step !== undefined ? r.step : recordTime(r);
        const agg = bySteps.get(key) || {t: recordTime(r), sum: 0, n: 0, max: 0, step: r.step, tokens: {}};
        agg.sum += r.step_s; agg.n += 1; agg.max = Math.max(agg.max, r.step_s);
        if (recordTime(r) > agg.t) agg.t = recordTime(r);
        modalities.forEach((m) => { agg.tokens[m] = (agg.tokens[m] || 0) + (r["tokens_" + m] || (r.tokens && r.tokens[m]) || 0); });
        bySteps.set(key, agg);
      });
      const points = Array.from(bySteps.values()).sort((a, b) => (a.t < b.t ? -1 : 1));
      if (!points.length) return;
      // Plotly owns the trace arrays: extendTraces appends to them (no copy kept here).
      const xs = points.map((p) => p.t);
      Plotly.extendTraces("chart-step", {x: [xs, xs], y: [points.map((p) => p.sum / p.n), points.map((p) => p.max)]}, [0, 1], MAX_POINTS);
      Plotly.extendTraces("chart-tokens", {x: modalities.map(() => xs), y: modalities.map((m) => points.map((p) => p.tokens[m] / p.n))}, [0, 1, 2, 3], MAX_POINTS);
      const last = points[points.length - 1];
      if (last.step !== undefined) $("#job-steps").textContent = last.step;
      growRange(xs[xs.length - 1]);
      clearNoData("chart-step");
      clearNoData("chart-tokens");
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
        const t = recordTime(s), util = s.util_pct !== undefined ? s.util_pct : s.util;
        if (heat) {  // the heat strip is redrawn from series; line traces are extended in place
          const trace = series.gpus[name] = series.gpus[name] || {t: [], util: []};
          trace.t.push(t); trace.util.push(util);
        }
        (perTrace[index] = perTrace[index] || {x: [], y: []}).x.push(t);
        perTrace[index].y.push(util);
      });
      const indices = Object.keys(perTrace).map(Number);
      if (!indices.length) return;
      if (heat) drawAll();
      else Plotly.extendTraces("chart-gpu", {x: indices.map((i) => perTrace[i].x), y: indices.map((i) => perTrace[i].y)}, indices, MAX_POINTS);
      bump(indices.reduce((n, i) => n + perTrace[i].x.length, 0));
      growRange(Math.max(...indices.map((i) => perTrace[i].x[perTrace[i].x.length - 1])));
      clearNoData("chart-gpu");
    }
    live.subscribe("job", data.job_id);
    ["step_records", "steps"].forEach((name) => live.on(name, (payloads) => appendSteps(payloads.flatMap(asRecords))));
    // telemetry.ingest sends {job, node, node_name, points: [{gpu, at, util_pct, ...}]}.
    ["gpu_samples", "gpu"].forEach((name) => live.on(name, (payloads) => appendGpus(payloads.flatMap(
      (p) => asRecords(p).map((r) => Object.assign({node: p.node, node_name: p.node_name}, r))))));
    live.on("job_event", (payloads) => payloads.forEach((p) => {
      const e = p.event, job = p.job;
      const log = $("#event-log");
      $$(".empty", log).forEach((n) => n.remove());
      const li = el("li", {class: "new", "data-event-id": e.id}, [
        el("span", {class: "when", text: fmtTime(e.at)}),
        el("span", {}, [el("span", {class: "kind kind-" + e.kind, text: e.kind}), " " + (e.sentence || e.text)]),
      ]);
      log.prepend(li);
      markers.push({t: e.at, kind: e.kind, label: e.kind_label, text: e.text});
      const shapes = markerShapes(markers);
      const stepDiv = document.getElementById("chart-step");
      Plotly.relayout(stepDiv, {shapes, annotations: markerAnnotations(markers).concat(hasPoints(stepDiv.data) ? [] : [NO_DATA])});
      Plotly.relayout("chart-gpu", {shapes});
      Plotly.relayout("chart-tokens", {shapes});
      $("#job-state").replaceChildren(statePill(job.state, job.state_label));
      $("#job-dp").textContent = job.dp;
      $("#job-accum").textContent = job.accum_steps;
      $("#job-gpus").textContent = job.gpus;
      $("#job-steps").textContent = job.committed_steps;
      $("#job-bar").style.width = (100 * job.progress).toFixed(1) + "%";
      const why = $("#why-pending");
      if (why && !["pending", "preempted"].includes(job.state)) why.hidden = true;
      if (e.kind === "checkpoint" || (e.outcome && e.outcome.checkpoint_step !== undefined)) {
        const body = $("#checkpoints");
        $$(".empty", body).forEach((n) => n.remove());
        const o = e.outcome || {};
        body.prepend(el("tr", {}, [el("td", {text: fmtTime(e.at)}), el("td", {class: "num", text: String(o.checkpoint_step ?? o.step ?? "—")}),
          el("td", {class: "num", text: o.save_s !== undefined ? Number(o.save_s).toFixed(1) + " s" : "—"})]));
      }
    }));
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
      button.title = node.name + " · " + node.state_label;
      const cells = $$(".gpu", button);
      node.gpus.forEach((g, i) => {
        if (!cells[i]) return;
        cells[i].className = "gpu" + (g.priority ? " p-" + g.priority : "") + (g.borrowed ? " borrowed" : "");
        cells[i].dataset.job = g.job || "";
        cells[i].title = "gpu" + g.index + ": " + (g.job ? g.job + (g.borrowed ? " (borrowed)" : "") : (g.held ? "another user's job" : "free"));
      });
      if (button === selected) showNode(button);
    }));

    // The queue: a job that stops waiting is struck through until the next load.
    live.on("job", (payloads) => payloads.forEach((job) => {
      const row = $("#queue tr[data-job-id='" + job.id + "']");
      if (!row) return;
      row.cells[2].replaceChildren(statePill(job.state, job.state_label));
      if (job.pending_reason) row.cells[5].textContent = job.pending_reason;
      row.style.opacity = ["pending", "preempted"].includes(job.state) ? "" : "0.45";
      flash(row);
    }));

    function drawCharts() {
      const gantt = data.gantt;
      const names = gantt.map((r) => r.name + " · " + r.gpus + " GPUs");
      const traces = [];
      gantt.forEach((r, i) => {
        r.windows.forEach(([s, e]) => traces.push({
          type: "scatter", mode: "lines", x: [s, e], y: [names[i], names[i]], line: {color: cssVar("--critical"), width: 18},
          name: "reserved window", legendgroup: "w", showlegend: false, hovertemplate: r.name + "<br>" + fmtTime(s) + " → " + fmtTime(e) + "<extra>" + r.job + "</extra>",
        }));
        r.loans.forEach((loan) => traces.push({
          type: "scatter", mode: "lines", x: [loan.since, loan.until], y: [names[i], names[i]], line: {color: cssVar("--borrowed"), width: 7},
          name: "loan", legendgroup: "l", showlegend: false, hovertemplate: loan.gpus + " GPUs lent to " + loan.job + " until " + fmtTime(loan.until) + "<extra></extra>",
        }));
      });
      traces.push({type: "scatter", mode: "lines", x: [null], y: [null], line: {color: cssVar("--critical"), width: 10}, name: "reserved window"});
      traces.push({type: "scatter", mode: "lines", x: [null], y: [null], line: {color: cssVar("--borrowed"), width: 6}, name: "GPUs on loan"});
      const height = Math.max(140, 70 + 38 * gantt.length);
      $("#chart-gantt").style.height = height + "px";
      Plotly.react("chart-gantt", traces, baseLayout({
        hovermode: "closest", margin: {l: 190, r: 16, t: 40, b: 44},
        legend: {orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom", font: {size: 11}},
        xaxis: Object.assign(baseLayout().xaxis, {range: [data.since, data.until]}),
        yaxis: {type: "category", automargin: true, gridcolor: cssVar("--line"), autorange: "reversed"},
        shapes: [{type: "line", xref: "x", yref: "paper", x0: data.now, x1: data.now, y0: 0, y1: 1, line: {color: cssVar("--fg"), width: 1, dash: "dot"}}],
        annotations: [{x: data.now, xref: "x", y: 1, yref: "paper", yanchor: "bottom", text: "now", showarrow: false, font: {size: 10}}],
      }), PLOT_CONFIG);
      const u = data.utilisation;
      Plotly.react("chart-util", [
        {x: u.t, y: u.allocated, name: "allocated", mode: "lines", line: {shape: "hv", color: cssVar("--regular"), width: 2}},
        {x: u.used_t, y: u.used, name: "used (utilisation × GPUs)", mode: "lines", line: {color: cssVar("--healthy"), width: 1.5}},
        {x: u.t, y: u.harvested, name: "harvested (on loan)", mode: "lines", fill: "tozeroy", line: {shape: "hv", color: cssVar("--borrowed"), width: 1.5}},
        {x: [u.t[0], u.t[u.t.length - 1]], y: [data.gpus_total, data.gpus_total], name: "capacity", mode: "lines", line: {color: cssVar("--faint"), dash: "dot", width: 1}},
      ], baseLayout({yaxis: Object.assign(baseLayout().yaxis, {title: {text: "GPUs"}})}), PLOT_CONFIG);
    }
    drawCharts();
    document.addEventListener("omni:theme", drawCharts);
  }

  // -- audit -----------------------------------------------------------------------------------
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
      const gpus = (e.gpus_before !== null || e.gpus_after !== null) ? (e.gpus_before ?? "·") + " → " + (e.gpus_after ?? "·") : "";
      const dp = (e.dp_before || e.dp_after) ? (e.dp_before ?? "·") + "×" + (e.accum_before ?? "·") + " → " + (e.dp_after ?? "·") + "×" + (e.accum_after ?? "·") : "";
      const row = el("tr", {class: "expandable flash", "data-event-id": e.id}, [
        el("td", {class: "num faint", text: e.id}), el("td", {class: "num", text: fmtFull(e.at)}),
        el("td", {}, [el("span", {class: "kind kind-" + e.kind, text: e.kind})]), el("td", {text: e.job || "—"}),
        el("td", {class: "mono small", text: (e.nodes_after.length ? e.nodes_after : e.nodes_before).join(", ")}),
        el("td", {text: e.actor}), el("td", {class: "num", text: gpus}), el("td", {class: "num", text: dp}), el("td", {class: "wrap", text: e.sentence || e.text}),
      ]);
      const detail = el("tr", {class: "detail", hidden: ""}, [el("td", {colspan: "9"}, [
        el("div", {class: "grid-2"}, [
          el("div", {}, [el("h3", {text: "Before → after"}), el("pre", {text: JSON.stringify({
            nodes: [e.nodes_before, e.nodes_after], gpus: [e.gpus_before, e.gpus_after], dp: [e.dp_before, e.dp_after],
            accum: [e.accum_before, e.accum_after], global_batch: e.global_batch}, null, 1)})]),
          el("div", {}, [el("h3", {text: "Rule and inputs"}), el("span", {class: "kind", text: e.rule || "—"}),
            el("pre", {text: JSON.stringify((e.reason || {}).inputs || {}, null, 2)}), el("h3", {text: "Outcome"}),
            el("pre", {text: JSON.stringify(e.outcome || {}, null, 2)})]),
        ]),
      ])]);
      table.prepend(row, detail);
    }));
  }

  window.Omni = {dashboard, jobPage, consolePage, auditPage, confirmDialog, LiveSocket};
  initTheme();
  initConfirmForms();
})();
