// The dashboard: wires the websocket stream (its `hello` brings the history a
// page needs, or on a reconnection what it missed), the dashboard state, the
// charts, the hook panel and the controls. Messages only touch the state and
// mark what changed; the charts are drawn once per animation frame. A large run
// (more than DETAIL_ALL tensors) is shown by groups; the page subscribes to the
// per-tensor detail of what it shows (picked, pinned, expanded, drilled into, worst
// now: at most MAX_DETAIL tensors) and backfills it over HTTP (GET /api/detail).

import { api, errorText, takeTokenFromUrl } from "./api.js";
import { can, connectionText, isReplay, setCapabilities, showThinnedNote } from "./capabilities.js";
import { FlowChart, HeatmapChart, HistChart, RatioChart } from "./charts.js";
import { LossChart } from "./losschart.js";
import { EventLog } from "./eventlog.js";
import { addExport } from "./exporting.js";
import { FlightCard } from "./flight.js";
import { HealthLine } from "./health.js";
import { HookPanel } from "./hookpanel.js";
import { MeasuredCards } from "./measuredcards.js";
import { NoiseChart } from "./noise.js";
import { OptimNowChart, OptimTimeChart } from "./optim.js";
import { PresetDialog } from "./presets.js";
import { RanksCard } from "./ranks.js";
import { RulesPanel, ruleDefinition } from "./rules.js";
import { Scheduler } from "./scheduler.js";
import { SELECTORS, byTestId } from "./selectors.js";
import { DashboardState, MAX_SNAPSHOTS } from "./state.js";
import { TensorPanel } from "./tensorpanel.js";
import { detailWindow, holesAfter } from "./detailfill.js";
import { Watch } from "./watch.js";
import { timeControls } from "./timecontrols.js";
import { Timeline } from "./timeline.js";
import { debounce, fmt, fmtPercent, fmtShortDate, h, nextRequestId, num, plottable } from "./util.js";
import { WhatIf } from "./whatif.js";
import { Connection } from "./ws.js";

const $ = (key) => byTestId(SELECTORS[key]); // an element of the page, by its SELECTORS key
const PRESET_FORMAT = "gradient-inspector/hooks"; // the preset format POST /api/hooks/import takes
const RATE_MAX = 10000; // the server's cap on steps_per_second (POST /api/training/rate)
const RATE_WINDOW = 6; // seconds of step counts the measured rate is taken over
const MAX_DETAIL = 256; // tensors a subscription's `detail` names, at most (the server's cap)
const BACKFILL_CHUNK = 64; // names per GET /api/detail

class Dashboard {
  constructor() {
    this.live = new DashboardState(); // the run being trained, fed by the stream
    this.view = this.live; // what the page shows: the live run or an earlier one
    this.histParam = null;
    this.connState = null;
    this.disconnected = false; // the socket is down: controls off, the state reads "disconnected"
    this.previousHooks = []; // the hooks of the run before a server restart (the restart banner)
    this.restart = null; // what the restart banner says: {previous, run, hooks, rules} (offerReapply)
    this.resetStep = null; // the step of the newest scenario_reset (the "try this" hint)
    this.stepSamples = []; // [time s, step] once a second: the measured steps/s

    this.log = new EventLog($("eventLog"));
    this.loss = new LossChart($("chartLoss"));
    const pick = (name) => this.pickParam(name);
    this.heatmap = new HeatmapChart($("chartHeatmap"), pick);
    this.flow = new FlowChart($("chartFlow"), pick);
    this.hist = new HistChart($("chartHist"));
    this.ratio = new RatioChart($("chartRatio"), pick);
    this.measured = new MeasuredCards(() => this.scheduler); // what is measured, beyond the main charts
    this.ranks = new RanksCard(byTestId("card-ranks")); // under torch.distributed only
    this.optimNow = new OptimNowChart(byTestId("chart-optim-now"), byTestId("optim-note")); // optim.js
    this.optimTime = new OptimTimeChart(byTestId("chart-optim-time"));
    this.noise = new NoiseChart(byTestId("chart-noise"), {
      status: byTestId("noise-status"),
      caveats: byTestId("noise-caveats"),
      select: byTestId("noise-group"),
      redraw: () => this.scheduler.resetNow("noise"),
    }); // noise.js
    this.flight = new FlightCard(byTestId("card-flight"), {
      spikes: () => this.view.markers.filter((m) => m.kind === "spike"),
      note: (text) => this.localEvent("spikes", text),
    }); // flight.js
    this.watch = new Watch({ open: (name) => this.openTensor(name), changed: () => this.subscribe() });
    // one tensor's panel, in view: opened (and closed again) by whatever picks a tensor
    this.tensorPanel = new TensorPanel({ view: () => this.view, open: (name) => this.openTensor(name) });
    this.measured.params.onOpen = (name) => this.openTensor(name); // a table row: picked everywhere
    this.health = new HealthLine(byTestId("health"), { open: (name) => this.openTensor(name) }); // health.js
    this.measured.params.pinButton = (name) => this.watch.pinButton(name, "table-pin");
    this.measured.params.onPicked = () => this.subscribe();
    this.heatmap.onExpand = () => {
      this.subscribe();
      this.scheduler.resetNow("heatmap");
    };
    for (const [name, chart] of [
      ["flow", this.flow],
      ["ratio", this.ratio],
    ]) {
      chart.onView = () => {
        this.subscribe();
        this.scheduler.resetNow(name);
      };
    }
    this.backfilled = new Set(); // parameter indices of the shown state whose detail was fetched
    this.holes = new Map(); // parameter index -> the newest step its backfill's answer held
    this.subscribeQueued = false;
    this.scheduler = new Scheduler(
      [
        ["loss", this.loss],
        ["heatmap", this.heatmap],
        ["flow", this.flow],
        ["ratio", this.ratio],
        ["hist", this.hist],
        ...this.measured.charts(),
        ["optimNow", this.optimNow],
        ["optimTime", this.optimTime],
        ["noise", this.noise],
      ],
      () => this.view,
      () => this.everyFrame(),
    );
    this.scheduler.observe();
    // The time charts' shared step axis, and the loss chart's own controls.
    this.timeline = new Timeline(
      () => this.view,
      (charts) => {
        this.scheduler.resetSome(charts);
        // older rows arrived: the tensors shown get their detail there too
        if (this.view.large && this.view.history.rows.length) {
          this.backfilled = new Set();
          this.subscribe();
        }
      },
    );
    for (const c of [this.loss, this.heatmap]) this.timeline.join(c);
    this.measured.join(this.timeline);
    this.timeline.join(this.optimTime);
    this.timeline.join(this.noise);
    this.timeControls = timeControls({
      header: $("chartLoss").closest(".card").querySelector(".card-head"),
      loss: this.loss,
      timeline: this.timeline,
      view: () => this.view,
      redraw: () => this.scheduler.resetNow("loss"),
      note: (text) => this.localEvent("history", text),
    });

    this.whatif = new WhatIf({
      card: $("chartLoss").closest(".card"),
      loss: this.loss,
      view: () => this.view,
      live: () => this.live,
      mark: (fn) => this.scheduler.mark(fn),
      note: (text) => this.localEvent("what-if", text),
    });
    this.whatif.onRewound = () => {
      this.resetCharts();
      this.showStep();
    };
    this.dialog = new PresetDialog($("presetDialog"));
    this.panel = new HookPanel({
      state: this.live,
      list: $("hookList"),
      form: $("addHookForm"),
      presets: document.querySelector('[data-role="presets"]'),
      dialog: this.dialog,
    });
    this.rules = new RulesPanel($("cardRules"), { view: () => this.view, live: () => this.live }); // rules.js
    this.bindControls();
    // CSV and PNG export on every chart card.
    for (const el of document.querySelectorAll(".card .chart"))
      addExport(el.closest(".card").querySelector(".card-head"), el);
    this.conn = new Connection({
      onMessage: (msg) => this.onMessage(msg),
      onState: (state, info) => this.onConnState(state, info),
      resume: () => this.resume(),
    });
  }

  start() {
    this.scheduler.resetAll();
    this.conn.start();
    // Training states (pause, resume, single step, rate, finished) are pushed; the run
    // picker reads the runs' step counts when it opens.
    setInterval(() => this.sampleRate(), 1000);
  }

  // ----- websocket -----

  onConnState(state, info) {
    const el = $("connectionStatus");
    const shown = state === "open" ? "live" : state;
    el.dataset.state = shown;
    if (state === "open") el.textContent = connectionText(state);
    else if (state === "connecting") el.textContent = info.attempt ? "reconnecting…" : "connecting…";
    else if (state === "reconnecting")
      el.textContent = `○ offline · retry in ${Math.ceil(info.delayMs / 1000)} s`;
    else el.textContent = "○ closed";
    // A refused handshake reads as a plain close: ask over HTTP whether it is the token.
    if (state === "reconnecting" && (info.code === 1008 || info.attempt >= 2)) this.checkAuth();
    if (state === "open" && this.connState !== null && this.connState !== "open") {
      this.localEvent("connection", "reconnected; the server sends what was missed");
    } else if (state === "reconnecting" && this.connState === "open") {
      this.localEvent("connection", `connection lost (code ${info.code ?? "?"}); reconnecting with backoff`);
    }
    if (state !== "connecting") this.connState = state;
    const down = state === "reconnecting" || state === "closed";
    if (state === "open" || down) this.setDisconnected(down);
  }

  /** While the socket is down nothing can be commanded: controls off, the state says so. */
  setDisconnected(on) {
    if (on === this.disconnected) return;
    this.disconnected = on;
    this.showTrainingState();
    this.applyReadOnly();
  }

  /** A refused socket: say so when it is the token (the retries go on). */
  async checkAuth() {
    const res = await api.session();
    if (res.status !== 401 && res.status !== 403) return;
    const el = $("connectionStatus");
    el.dataset.state = "unauthorized";
    el.textContent = res.status === 401 ? "○ token needed: open the URL printed at start-up" : "○ refused";
    el.title = errorText(res);
  }

  /**
   * What the page has of the live run, for the websocket's query (ws.js): on a
   * reconnection the server's `hello` then carries only what came after.
   */
  resume() {
    const live = this.live;
    if (live.runId === null) return {};
    return {
      run: live.runId,
      step: live.step,
      since: live.latest ? live.latest.step : undefined,
      seq: live.lastSeq >= 0 ? live.lastSeq : undefined,
    };
  }

  onMessage(msg) {
    if (msg.type === "hello") this.onHello(msg);
    else this.apply(msg);
  }

  apply(msg) {
    const live = this.live;
    switch (msg.type) {
      case "snapshot": {
        const row = live.addSnapshot(msg.data);
        if (!row || this.view !== live) break;
        if (live.large && this.worstChanged(row)) this.subscribe(); // worst-now tensors get their history
        this.refillHoles(live);
        const lossY = row.lossAdded ? live.loss.y[live.loss.y.length - 1] : null;
        const pruned = live.pruneMarkers();
        const hist = Boolean(msg.data.hist && this.histParam && msg.data.hist[this.histParam]);
        this.scheduler.mark((p, name) => {
          if (name === "hist") return hist;
          p.rows.push(row);
          if (row.lossAdded) pushLoss(p, row.step, lossY);
          if (pruned) p.markers = true;
          return true;
        });
        this.statsDirty = true;
        this.rules.onStep(); // the rules' evaluation state
        break;
      }
      case "scalars": {
        const step = num(msg.step);
        const loss = num(msg.loss);
        live.step = Math.max(live.step, step ?? 0);
        if (live.addLoss(step, loss) && this.view === live) {
          const y = live.loss.y[live.loss.y.length - 1];
          this.scheduler.mark((p, name) => name === "loss" && pushLoss(p, step, y));
        }
        this.scheduler.request(); // the step counter
        if (this.view === live) this.rules.onStep(); // (a loss rule is evaluated once the loss arrived)
        break;
      }
      case "event":
        this.addEvent(msg.data);
        break;
      case "training": {
        // pause / resume / single step / rate / finished, from any tab or from Python, pushed
        const { type, ...training } = msg;
        live.training = { ...live.training, ...training };
        live.step = Math.max(live.step, num(training.step) ?? 0);
        if (this.view === live) this.showSession();
        this.showStep();
        break;
      }
      case "hooks":
        // one applied change: the hook list it leaves, and its hook_applied event
        if (live.applyHooks(msg.hooks || [], msg.config_version)) {
          if (this.view === live) this.panel.render();
          this.showConfigVersion();
        }
        if (msg.event) this.addEvent(msg.event);
        break;
      case "requested":
        // a page's change accepted: its rows show pending until the hooks message of that version
        if (live.applyRequested(msg.hooks || [], msg.config_version) && this.view === live)
          this.panel.render();
        break;
      case "error":
        this.localEvent("server_error", errorText({ data: msg })); // `detail` as in an HTTP error
        break;
      case "shadow":
      case "shadow_state":
        this.whatif.onMessage(msg);
        break;
      case "flight": // a flight recorder dump (flight.js)
        if (this.view === live) this.flight.onMessage(msg);
        break;
      default:
        break; // ack: mutations go over HTTP; the subscribe ack needs nothing
    }
  }

  addEvent(ev) {
    if (!this.live.addEvent(ev)) return;
    this.whatif.onEvent(ev);
    this.rules.onEvent(ev);
    if (ev.kind === "scenario_reset") {
      this.resetStep = num(ev.step);
      if (this.view === this.live) this.showSession();
    }
    if (this.view !== this.live) return;
    this.log.addServerEvent(ev);
    const marked = [
      "hook_applied",
      "nonfinite",
      "step_skipped",
      "scenario_reset",
      "rewind",
      "batches_skipped",
      "rule_fired",
      "rule_failed",
    ];
    if (marked.includes(ev.kind)) {
      this.scheduler.mark((p, name) => (name === "loss" || name === "heatmap") && (p.markers = true));
      this.statsDirty = true;
    }
    if (ev.kind === "spike") {
      this.scheduler.mark((p, name) => name === "loss" && (p.markers = true));
      this.flight.onSpike(num(ev.step));
    }
    if (ev.kind === "rewind") this.flight.onRewind(num(ev.step));
  }

  localEvent(kind, text) {
    const ev = { kind, text, time: Date.now() / 1000 };
    this.live.addEvent(ev); // kept (bounded) so the log can be redrawn after viewing another run
    if (this.view === this.live) this.log.addLocal(kind, text);
  }

  /**
   * A (re)connection: the session, and the newest history and events (those
   * after what the page had, when the server `resumed` its run: the same
   * process, no step lost). A new run (the server restarted; without a
   * database every process is run 0, and its step count went back): start
   * over from it.
   */
  onHello(msg) {
    const session = msg.session || {};
    setCapabilities(session); // what this server serves: nothing else is asked of it
    if (this.connState === "open") $("connectionStatus").textContent = connectionText("open");
    const live = this.live;
    const sameRun = Boolean(msg.resumed) && live.runId !== null && live.runId === session.run_id;
    if (!sameRun) {
      const previous = live.runId;
      const before = [...live.hooks.values()];
      const beforeRules = this.view === live ? this.rules.rules.map(ruleDefinition) : [];
      live.setSession(session);
      this.resetStep = null;
      this.stepSamples = []; // the rate is of this run's steps
      if (previous !== null) this.offerReapply(previous, before, beforeRules, session);
      this.log.clear();
      if (previous !== null)
        this.localEvent(
          "run",
          `new run ${session.run_id} (the server restarted; run ${previous} is in the run picker)`,
        );
      else this.localEvent("connection", `connected to run ${session.run_id}`);
    } else {
      live.session = session;
      live.setHooks(session.hooks || [], session.config_version);
      live.training = { ...live.training, ...(session.training || {}) };
      live.readOnly = Boolean(session.read_only);
      live.step = Math.max(live.step, num(live.training.step) || 0);
    }
    for (const s of msg.history || []) live.addSnapshot(s); // oldest first
    for (const ev of msg.events || []) {
      if (live.addEvent(ev) && this.view === live) this.log.addServerEvent(ev);
      if (ev.kind === "scenario_reset") this.resetStep = num(ev.step); // the newest
    }
    if (!sameRun) {
      this.panel.resetSession();
      this.fillParamSelect();
    } else {
      this.panel.render();
    }
    if (!sameRun) this.backfilled = new Set();
    if (!sameRun) this.holes.clear();
    this.subscribe();
    if (this.view === live) this.resetCharts();
    this.showSession();
    // the shadow belongs to the loss chart and its messages may start any moment: its state is
    // asked for now (a later load would wipe what its messages drew meanwhile); the page's other
    // requests go once the next frame has drawn (the loss chart)
    const shown = this.view === live;
    if (shown) this.whatif.load();
    this.scheduler.nextDraw().then(() => this.loadAfterHello(live, session, shown));
    if (this.pendingRun !== undefined) {
      const run = this.pendingRun;
      this.pendingRun = undefined;
      if (run !== null && String(run) !== String(live.runId)) this.openRun(run);
    }
  }

  /**
   * What a hello's charts do not wait for: the run picker, and when the live run was shown at the
   * hello (`shown`), the flight recorder and rules.
   */
  loadAfterHello(live, session, shown) {
    this.loadRuns();
    if (!shown) return;
    this.flight.setGroups(live.groups ? live.groups.names : []);
    const stored = live.readOnly || Boolean(session.history && session.history.db); // (a replay reads one)
    this.flight.load(live.runId, { live: !live.readOnly, stored });
    this.rules.load();
  }

  // ----- drawing -----

  /** Cheap updates on every frame: counters, stats, hook effects. */
  everyFrame() {
    this.showStep();
    this.tensorPanel.update();
    this.whatif.bind();
    this.health.show(this.view, this.view === this.live);
    if (!this.statsDirty) return;
    this.statsDirty = false;
    this.showStats();
    this.watch.showWorst();
    const v = this.view;
    this.panel.showEffects({ ...(v.latest ? v.latest.hook_effects : {}), ...this.measured.moduleEffects(v) });
    this.ranks.show(v.latest, v.params, v.groups ? v.groups.names : []);
    if (!this.histParam) this.defaultHistParam();
    this.showHistStatus();
    if (v !== this.live || isReplay() || v.history.rows.length) showThinnedNote(v);
  }

  resetCharts() {
    this.timeline.reset();
    this.timeControls.reset();
    this.view.pruneMarkers();
    this.scheduler.resetAll();
    this.statsDirty = true;
  }

  /** The step counter (written only when it changed: a write on every frame is a layout to redo). */
  showStep() {
    const text = String(this.view.step);
    const el = $("stepCounter");
    if (el.textContent !== text) el.textContent = text;
  }

  showStats() {
    const row = this.view.latest;
    $("overhead").textContent = row ? fmtPercent(row.overhead) : "–";
    const k = row ? num(row.sampled_every) : null;
    $("cadence").textContent = k === null ? "–" : k === 1 ? "every step" : `every ${k} steps`;
  }

  showConfigVersion() {
    const el = document.querySelector('[data-role="config-version"]');
    el.textContent = `config v${this.view.configVersion}`;
  }

  showSession() {
    const v = this.view;
    const t = v.training || {};
    document.body.dataset.run = String(this.live.runId);
    document.body.dataset.view = String(v.runId);
    const sc = v.session && typeof v.session.scenario === "object" ? v.session.scenario : null;
    $("scenario").textContent = t.scenario ? `scenario: ${t.scenario}` : "your training";
    $("scenario").title = sc && sc.description ? sc.description : "";
    const tryThis = document.querySelector('[data-role="try-this"]');
    const again =
      this.resetStep !== null && v === this.live
        ? ` The scenario was reset at step ${this.resetStep} (fresh weights, same hooks): you can try it again.`
        : "";
    tryThis.textContent = sc && sc.try_this ? `Try this: ${sc.try_this}${again}` : "";
    tryThis.hidden = !(sc && sc.try_this) || v !== this.live || !can("commands"); // a replay is read, not followed
    this.showTrainingState();
    // The cap (demo mode, live run only): 0 reads "no cap", as the CLI's --steps-per-second.
    const rateWrap = document.querySelector('[data-role="rate-wrap"]');
    const sps = num(t.steps_per_second);
    rateWrap.hidden = !(v === this.live && this.live.session && this.live.session.mode === "demo");
    const rate = $("rate");
    if (document.activeElement !== rate) rate.value = sps === null ? "0" : String(sps);
    this.showMeasuredRate();
    this.showConfigVersion();
    this.applyReadOnly();
  }

  showTrainingState() {
    const el = $("trainingState");
    let state = this.view === this.live ? this.live.training.state || "running" : "history";
    if (this.disconnected && this.view === this.live) state = "disconnected";
    el.textContent = state;
    el.dataset.state = state;
    // the demo holds before the step its hint names: why, until it is resumed
    const why = this.view === this.live && state === "paused" ? this.live.training.pause_reason : null;
    let reason = $("pauseReason");
    if (!reason && why) {
      reason = h("p", { class: "pause-reason", dataset: { testid: SELECTORS.pauseReason }, role: "status" });
      document.querySelector('[data-role="try-this"]').before(reason);
    }
    if (reason) {
      reason.textContent = why ? `❚❚ ${why}` : "";
      reason.hidden = !why;
    }
    el.title = why || "";
  }

  applyReadOnly() {
    const ro = this.view !== this.live || this.live.readOnly;
    $("readOnlyBadge").hidden = !ro;
    $("readOnlyBadge").textContent = this.view !== this.live ? "read-only: earlier run" : "read-only";
    const off = ro || (this.disconnected && this.view === this.live); // nothing to command
    for (const id of ["pause", "resume", "step", "rate", "reapplyHooks", "reapplyRules"])
      $(id).disabled = off;
    this.panel.setReadOnly(off, this.view !== this.live);
    this.rules.setReadOnly(off, this.view !== this.live);
    document.body.classList.toggle("read-only", ro);
  }

  // ----- histogram parameter -----

  fillParamSelect() {
    this.measured.setParams(this.view.params);
    this.watch.setState(this.view);
    this.heatmap.expanded.clear();
    this.flow.drill = this.flow.depth = null;
    this.ratio.drill = this.ratio.depth = null;
    const sel = $("histParam");
    sel.replaceChildren(...this.view.params.map((p) => h("option", { value: p }, p)));
    if (this.histParam && this.view.params.includes(this.histParam)) sel.value = this.histParam;
    else {
      this.histParam = null;
      sel.value = "";
    }
  }

  defaultHistParam() {
    const v = this.view;
    const row = v.latest;
    if (!row || !v.params.length) return;
    let best = 0;
    let bestV = -Infinity;
    const values = v.large ? (row.groups && row.groups.norm_raw) || [] : row.grad_norm_raw || [];
    values.forEach((x, i) => {
      const n = plottable(x);
      if (n !== null && n > bestV) {
        bestV = n;
        best = i;
      }
    });
    // A large run: the worst-now tensor, else the first tensor of the group with the largest norm.
    if (v.large) {
      const worst = row.worst && row.worst.length ? row.worst[0].param : null;
      best = worst !== null && v.params[worst] !== undefined ? worst : (v.groups.members[best] || [0])[0];
    }
    // a recorded run (a replay, an earlier run) has the histograms it kept: start on one of those
    const stored = v !== this.live || isReplay();
    if (stored && v.hists.size && !v.hists.has(v.params[best])) {
      const kept = v.params.filter((p) => v.hists.has(p));
      const value = (p) => plottable((v.large ? [] : row.grad_norm_raw || [])[v.index.get(p)]) ?? -Infinity;
      kept.sort((a, b) => value(b) - value(a));
      best = v.index.get(kept[0]);
    }
    this.pickParam(v.params[best], { auto: true });
  }

  /**
   * Open a tensor everywhere (a click on its name in worst now, the search, a pin, the statistics
   * table or an event): its panel opens (or closes: a second click), the histogram and the
   * parameter statistics pick it; in a large run the heatmap expands its group down to it and
   * the bar charts drill into its group.
   */
  openTensor(name) {
    const v = this.view;
    const i = v.index.get(name);
    if (i === undefined) return;
    this.pickParam(name);
    if (v.large) {
      this.heatmap.expandTo(v, i);
      this.scheduler.resetNow("heatmap");
      for (const [id, chart] of [
        ["flow", this.flow],
        ["ratio", this.ratio],
      ]) {
        chart.drill = v.groupOf[i];
        chart.depth = null;
        chart.depthSelect.value = "";
        this.scheduler.resetNow(id);
      }
    }
    this.subscribe();
  }

  /** Whether this row's worst-now tensors are not all among those the page has detail of. */
  worstChanged(row) {
    return (row.worst || []).some((w) => !this.live.want.has(w.param));
  }

  /**
   * The tensors whose detail the page shows, in order of preference (picked, the histogram's,
   * pinned, the heatmap's expanded rows, the bars drilled into, worst now), at most MAX_DETAIL.
   */
  wantedDetail(v) {
    const out = new Set();
    const add = (i) => {
      if (i !== undefined && i !== null && out.size < MAX_DETAIL) out.add(i);
    };
    for (const p of this.measured.params.picked) add(v.index.get(p));
    if (this.histParam) add(v.index.get(this.histParam));
    if (this.tensorPanel.name) add(v.index.get(this.tensorPanel.name));
    for (const i of this.watch.pinnedIndices()) add(i);
    for (const i of this.heatmap.wanted()) add(i);
    for (const i of this.flow.wanted(v)) add(i);
    for (const i of this.ratio.wanted(v)) add(i);
    for (const w of (v.latest && v.latest.worst) || []) add(w.param);
    return [...out];
  }

  /** Subscribe (once per task, however many changes asked): histogram, and detail for a large run. */
  subscribe() {
    if (this.subscribeQueued) return;
    this.subscribeQueued = true;
    queueMicrotask(() => {
      this.subscribeQueued = false;
      this.sendSubscribe();
    });
  }

  sendSubscribe() {
    const v = this.view;
    const want = v.large ? this.wantedDetail(v) : [];
    v.want = new Set(want);
    if (v === this.live) {
      const cmd = { type: "subscribe", request_id: nextRequestId() };
      if (this.histParam) cmd.hist = [this.histParam];
      if (v.large) cmd.detail = want.map((i) => v.params[i]);
      if (cmd.hist || cmd.detail) this.conn.send(cmd);
    }
    if (v.large) this.backfill(v, want);
  }

  /** The holes a backfill left (steps stored after it answered): asked for again, once a step later. */
  refillHoles(v) {
    if (!this.holes.size || !v.large) return;
    const since = Math.min(...this.holes.values());
    const want = [...this.holes.keys()];
    this.holes.clear();
    this.backfill(v, want, since);
  }

  /** Fetch the held steps' detail of tensors not fetched before (GET /api/detail), in chunks. */
  async backfill(v, want, after = null) {
    const fresh = after === null ? want.filter((i) => !this.backfilled.has(i)) : want;
    if (!fresh.length || v.runId === null) return;
    for (const i of fresh) this.backfilled.add(i);
    for (let k = 0; k < fresh.length; k += BACKFILL_CHUNK) {
      const names = fresh.slice(k, k + BACKFILL_CHUNK).map((i) => v.params[i]);
      const { since, limit } = detailWindow(v, names.length, after);
      const res = await api.detail({ params: names, run: v.runId, since, limit });
      if (this.view !== v) return;
      if (!res.ok) {
        for (const n of names) this.backfilled.delete(v.index.get(n)); // asked again next time
        return;
      }
      const asked = names.map((n) => v.index.get(n));
      // steps that streamed in without their detail after the server answered: asked once more
      for (const [i, last] of holesAfter(v, asked, res.data.steps || [])) this.holes.set(i, last);
      if (v.mergeDetail(res.data)) {
        // redrawn: the charts that show one of these tensors (the heatmap and the bars only
        // where expanded or drilled into; the statistics follow every tensor the page does)
        const got = new Set(names.map((n) => v.index.get(n)));
        const shows = (list) => list.some((i) => got.has(i));
        const charts = [this.measured.params];
        if (shows(this.heatmap.wanted())) charts.push(this.heatmap);
        if (shows(this.flow.wanted(v))) charts.push(this.flow);
        if (shows(this.ratio.wanted(v))) charts.push(this.ratio);
        this.scheduler.resetSome(charts);
        this.statsDirty = true;
      }
    }
  }

  /**
   * A parameter picked: the histogram shows it and the parameter statistics add it; a pick by a
   * click (`panel`) opens its tensor panel, or closes it when it shows that tensor already. The
   * page's own first choice (`auto`, the histogram's default) joins the statistics only while
   * nothing is picked there: a filter typed before the first snapshot arrived keeps what it picked.
   */
  pickParam(name, { auto = false, panel = !auto } = {}) {
    if (!name || !this.view.params.includes(name)) return;
    this.histParam = name;
    $("histParam").value = name;
    this.hist.param = name;
    this.scheduler.resetNow("hist");
    this.measured.pick(name, { stats: !auto || !this.measured.params.picked.length });
    this.subscribe();
    this.showHistStatus();
    if (panel) this.tensorPanel.toggle(name);
  }

  showHistStatus() {
    const el = $("histStatus");
    const hg = this.histParam ? this.view.latestHist(this.histParam) : null;
    if (!this.histParam)
      el.textContent = "pick a parameter: click the heatmap or the flow chart, or use the list";
    else if (!hg && (this.view !== this.live || isReplay())) {
      const kept = [...this.view.hists.keys()];
      el.textContent = kept.length
        ? `no histogram of ${this.histParam} was recorded; this run kept those of ${kept.slice(0, 4).join(", ")}${kept.length > 4 ? ", …" : ""}`
        : "this run recorded no histograms";
    } else if (!hg)
      el.textContent = `waiting for a histogram of ${this.histParam} (taken every few sampled steps)`;
    else el.textContent = `${this.histParam} · step ${hg.step}`;
  }

  // ----- controls -----

  bindControls() {
    $("pause").addEventListener("click", () => this.training("pause"));
    $("resume").addEventListener("click", () => this.training("resume"));
    $("step").addEventListener("click", () => this.training("step"));
    $("rate").addEventListener("change", () => this.setRate());
    $("rate").addEventListener("keydown", (ev) => ev.key === "Enter" && $("rate").blur());
    $("reapplyHooks").addEventListener("click", () => this.reapply());
    $("reapplyRules").addEventListener("click", () => this.reapplyRules());
    $("restartDismiss").addEventListener("click", () => ($("restartBanner").hidden = true));
    segmented($("lossScale"), (v) => {
      this.loss.lossLog = v === "log";
      this.scheduler.resetNow("loss");
    });
    segmented($("heatmapSource"), (v) => {
      this.heatmap.source = v;
      this.scheduler.resetNow("heatmap");
    });
    segmented($("flowMetric"), (v) => {
      this.flow.metric = v;
      this.scheduler.resetNow("flow");
    });
    segmented($("histScale"), (v) => {
      this.hist.logY = v === "log";
      this.scheduler.resetNow("hist");
    });
    $("histParam").addEventListener("change", () => this.pickParam($("histParam").value, { panel: false }));
    const picker = $("runPicker");
    picker.addEventListener("focus", () => this.loadRuns(true));
    picker.addEventListener("change", () => {
      const id = picker.value;
      if (String(id) === String(this.live.runId)) this.backToLive();
      else this.openRun(id);
    });
    $("backToLive").addEventListener("click", () => this.backToLive());
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) this.scheduler.request();
    });
    // Tick density and the heatmap's height depend on the size: redraw once resizing stops.
    window.addEventListener(
      "resize",
      debounce(() => this.scheduler.resetAll(), 300),
    );
  }

  /** The steps/s field: 0 lifts the cap; negatives, text and values past the server's cap are refused here. */
  async setRate() {
    const input = $("rate");
    const text = input.value.trim();
    const v = text === "" ? NaN : Number(text);
    let error = null;
    if (!Number.isFinite(v)) error = `not a number: ${text === "" ? "(empty)" : text}; 0 for no cap`;
    else if (v < 0) error = `must be ≥ 0 (0: no cap), got ${text}`;
    else if (v > RATE_MAX) error = `at most ${RATE_MAX} steps/s (0: no cap), got ${text}`;
    if (error === null) {
      const res = await api.rate(v === 0 ? null : v);
      if (res.ok) {
        const sps = res.data ? num(res.data.steps_per_second) : null;
        this.live.training.steps_per_second = sps;
        this.showRateError(null);
        input.value = sps === null ? "0" : String(sps);
        return;
      }
      error = errorText(res);
    }
    this.showRateError(error);
    const sps = num(this.live.training.steps_per_second);
    input.value = sps === null ? "0" : String(sps); // back to the cap in force
  }

  showRateError(msg) {
    $("rateError").textContent = msg || "";
    $("rate").setAttribute("aria-invalid", msg ? "true" : "false");
  }

  /** Once a second: the live step count, for the measured rate beside the cap. */
  sampleRate() {
    const now = performance.now() / 1000;
    this.stepSamples.push([now, this.live.step]);
    while (this.stepSamples.length > RATE_WINDOW + 1) this.stepSamples.shift();
    this.showMeasuredRate();
  }

  showMeasuredRate() {
    const el = $("rateMeasured");
    const s = this.stepSamples;
    const running = (this.live.training.state || "running") === "running" && !this.disconnected;
    if (!running || s.length < 3) {
      el.textContent = "";
      return;
    }
    const [t0, s0] = s[0];
    const [t1, s1] = s[s.length - 1];
    el.textContent = t1 > t0 ? `≈ ${fmt(Math.max(0, s1 - s0) / (t1 - t0), 2)}/s` : "";
  }

  /**
   * A server restart started a new run without the page's hooks or rules: say
   * so, and offer each back: the previous run's hooks (a preset import, one
   * change), and its rules that the new run lacks (a `rules=` file brings them
   * back by itself) as they stood, an enabled flag a rule set by itself
   * included. The new run's rules are asked for here.
   */
  offerReapply(previous, before, beforeRules, session) {
    const key = (x) => JSON.stringify([x.kind, x.point, x.target, x.params, x.enabled]);
    const now = (session.hooks || []).map(key).sort().join("|");
    this.previousHooks = before.filter((x) => x.kind !== "python"); // Python callables stay in Python
    const hooksDiffer = before.length > 0 && before.map(key).sort().join("|") !== now;
    const restart = {
      previous,
      run: session.run_id,
      hooks: hooksDiffer
        ? {
            n: before.length,
            py: before.length - this.previousHooks.length,
            now: (session.hooks || []).length,
          }
        : null,
      rules: [],
    };
    this.restart = restart;
    this.showRestart();
    if (!beforeRules.length) return;
    api.rules().then((res) => {
      if (this.restart !== restart || !res.ok || !res.data) return;
      const have = new Set((res.data.rules || []).map((r) => JSON.stringify(ruleDefinition(r))));
      restart.rules = beforeRules.filter((d) => !have.has(JSON.stringify(d)));
      this.showRestart();
    });
  }

  /** The restart banner, from `this.restart`: hidden when nothing is missing. */
  showRestart() {
    const banner = $("restartBanner");
    const r = this.restart;
    if (r === null || (r.hooks === null && !r.rules.length)) {
      banner.hidden = true;
      return;
    }
    const parts = [];
    if (r.hooks !== null) {
      const { n, py } = r.hooks;
      parts.push(
        `its hooks are not the previous run's (run ${r.previous} had ${n} hook${n === 1 ? "" : "s"}` +
          `${py ? `, ${py} of them Python callables that only Python can add back` : ""}; this run has ${r.hooks.now})`,
      );
    }
    if (r.rules.length) {
      const m = r.rules.length;
      parts.push(`${m} rule${m === 1 ? "" : "s"} of run ${r.previous} ${m === 1 ? "is" : "are"} not in it`);
    }
    banner.querySelector('[data-role="restart-text"]').textContent = `New run ${r.run}: ${parts.join("; ")}.`;
    $("reapplyHooks").hidden = r.hooks === null || !this.previousHooks.length;
    $("reapplyHooks").title = "replace this run's hooks with the previous run's (one change)";
    $("reapplyRules").hidden = !r.rules.length;
    $("reapplyRules").title =
      "add the previous run's rules as they stood (a rule naming a hook id names it in this run)";
    banner.hidden = false;
  }

  async reapply() {
    const hooks = this.previousHooks.map(({ kind, point, target, params, enabled }) => ({
      kind,
      point,
      target,
      params,
      enabled,
    }));
    $("reapplyHooks").disabled = true;
    const res = await api.importHooks({ format: PRESET_FORMAT, version: 1, hooks });
    $("reapplyHooks").disabled = false;
    const text = $("restartBanner").querySelector('[data-role="restart-text"]');
    if (!res.ok) {
      text.textContent = `The previous run's hooks could not be re-applied: ${errorText(res)}`;
      return;
    }
    if (this.restart !== null) this.restart.hooks = null;
    this.showRestart();
    this.localEvent(
      "hooks",
      `re-applied the previous run's ${hooks.length} hook${hooks.length === 1 ? "" : "s"}`,
    );
  }

  /** The previous run's missing rules, added one by one (a refused one stops it, with the reason). */
  async reapplyRules() {
    const r = this.restart;
    if (r === null) return;
    $("reapplyRules").disabled = true;
    const done = [];
    let failed = null;
    for (const rule of r.rules) {
      const res = await api.addRule(rule);
      if (!res.ok) {
        failed = res;
        break;
      }
      done.push(rule);
    }
    $("reapplyRules").disabled = false;
    r.rules = r.rules.filter((d) => !done.includes(d));
    this.showRestart();
    if (done.length)
      this.localEvent(
        "rules",
        `re-applied ${done.length} rule${done.length === 1 ? "" : "s"} of run ${r.previous}`,
      );
    if (failed !== null) {
      const text = $("restartBanner").querySelector('[data-role="restart-text"]');
      text.textContent = `A rule of run ${r.previous} could not be re-applied: ${errorText(failed)}`;
    }
  }

  async training(action) {
    const before = this.live.step;
    const res = await api.training(action);
    if (!res.ok) {
      this.localEvent("training", `${action}: ${errorText(res)}`);
      return;
    }
    if (res.data && res.data.state) this.live.training.state = res.data.state;
    this.showTrainingState();
    this.localEvent(
      "training",
      `${action} requested (step ${res.data && res.data.step !== undefined ? res.data.step : before})`,
    );
  }

  async loadRuns(force = false) {
    const picker = $("runPicker");
    if (!force && document.activeElement === picker && picker.options.length) return; // being chosen from
    const res = await api.runs();
    if (!res.ok) return;
    const runs = (res.data.runs || []).slice().sort((a, b) => num(b.id) - num(a.id));
    picker.replaceChildren(
      ...runs.flatMap((r) => [
        h(
          "option",
          { value: String(r.id) },
          `#${r.id}${r.scenario ? ` ${r.scenario}` : ""} · ${
            r.live ? "live" : `${num(r.steps) ?? 0} step${num(r.steps) === 1 ? "" : "s"}`
          } · ${fmtShortDate(r.started)}`,
        ),
        ...branchOptions(r.branches || [], 1), // what-if: shadows and abandoned branches, under their run
      ]),
    );
    picker.value = String(this.view.runId ?? this.live.runId);
  }

  /** Show an earlier run of the database, read-only, from its stored history. */
  async openRun(id) {
    const [sess, snaps, evs] = await Promise.all([
      api.session(id),
      api.snapshots({ run: id, points: MAX_SNAPSHOTS }),
      api.events({ run: id }),
    ]);
    if (!sess.ok) {
      this.localEvent("run", `run ${id}: ${errorText(sess)}`);
      $("runPicker").value = String(this.view.runId);
      return;
    }
    const state = new DashboardState();
    state.setSession(sess.data);
    state.readOnly = true;
    for (const s of (snaps.ok && snaps.data.snapshots) || []) state.addSnapshot(s);
    for (const ev of ((evs.ok && evs.data.events) || []).slice(-400)) state.addEvent(ev);
    if (state.latest) state.step = state.latest.step;
    this.view = state;
    this.backfilled = new Set();
    this.holes.clear();
    this.panel.state = state;
    this.panel.resetSession();
    this.renderLog();
    this.fillParamSelect();
    this.subscribe();
    this.resetCharts();
    this.showSession();
    const banner = $("historyBanner");
    banner.hidden = false;
    banner.querySelector('[data-role="history-text"]').textContent =
      `Run ${state.runId}${state.training.scenario ? ` (${state.training.scenario})` : ""}: stored history, ${state.snapshots.length} sampled steps up to step ${state.step}. Read-only.`;
    $("runPicker").value = String(state.runId);
    setRunInUrl(state.runId);
    this.whatif.load();
    this.rules.load();
  }

  backToLive() {
    this.view = this.live;
    this.panel.state = this.live;
    this.panel.resetSession();
    this.renderLog();
    this.fillParamSelect();
    $("historyBanner").hidden = true;
    this.resetCharts();
    this.showSession();
    this.backfilled = new Set();
    this.holes.clear();
    this.subscribe();
    $("runPicker").value = String(this.live.runId);
    setRunInUrl(null);
    this.whatif.load();
    this.rules.load();
  }

  renderLog() {
    this.log.clear();
    for (const ev of this.view.events) {
      if (ev.text !== undefined) this.log.add(ev.kind, ev.text, ev.time, null);
      else this.log.addServerEvent(ev);
    }
  }
}

/** Options for a run's branches (and theirs), indented under it. */
function branchOptions(branches, depth) {
  return branches.flatMap((b) => [
    h(
      "option",
      { value: String(b.id), dataset: { branch: b.branch || "" } },
      `${"\u00a0\u00a0".repeat(depth)}↳ #${b.id} ${b.label || b.branch} (after step ${b.branch_step})`,
    ),
    ...branchOptions(b.branches || [], depth + 1),
  ]);
}

function pushLoss(pending, step, loss) {
  const x = pending.loss.x;
  if (x.length && step <= x[x.length - 1]) return true;
  x.push(step);
  pending.loss.y.push(loss);
  return true;
}

/** A segmented control: buttons with data-value, one pressed at a time. */
function segmented(el, onChange) {
  el.addEventListener("click", (ev) => {
    const btn = ev.target.closest("button[data-value]");
    if (!btn || btn.getAttribute("aria-pressed") === "true") return;
    for (const b of el.querySelectorAll("button"))
      b.setAttribute("aria-pressed", b === btn ? "true" : "false");
    onChange(btn.dataset.value);
  });
}

function setRunInUrl(run) {
  const url = new URL(window.location.href);
  if (run === null) url.searchParams.delete("run");
  else url.searchParams.set("run", String(run));
  window.history.replaceState(window.history.state, "", url.pathname + url.search + url.hash);
}

export function render() {
  takeTokenFromUrl();
  const dash = new Dashboard();
  const run = new URL(window.location.href).searchParams.get("run");
  dash.pendingRun = run === null ? undefined : run;
  dash.start();
  // The page's handle: scripts/screenshots.py waits on window.__dashboard.scheduler
  // (every chart drawn) before a capture; also handy from the console.
  window.__dashboard = dash;
  return dash;
}
