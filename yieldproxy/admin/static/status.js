// yieldproxy status page: polls /status and /history on this admin listener
// every two seconds and draws the last hour as inline SVG.  Plain JavaScript,
// no build step, no external resources (the page's CSP allows none).
//
// Hold reasons and sources are text written by callers of POST /yield: they
// are only ever put in the page with textContent, never parsed as HTML.
"use strict";

(function () {
  const POLL_MS = 2000;
  const TOKEN_KEY = "yieldproxy.admin-token";
  const SVG_NS = "http://www.w3.org/2000/svg";
  const CLASS_ORDER = ["interactive", "batch", "long"];
  const WAITING_SHOWN = 10; // parked requests listed; the rest are counted ("and K more")

  const $ = (id) => document.getElementById(id);

  const page = {
    samples: [], // oldest first, as GET /history gives them
    lastT: null, // the newest sample's t: the next poll asks only for newer ones
    interval: 1,
    capacity: 3600,
    classes: CLASS_ORDER.slice(),
    upstreams: [], // names, in /status order: each sample has each one's state
    serverNow: null,
    startedAt: null, // /status started_at: the chart's time axis starts no earlier (unless history is older)
    wallOffset: null, // GET /history's wall_offset: when it changes, every t has moved
    status: null,
    timer: null,
    waitingForToken: false,
    token: null, // only used when sessionStorage is not available
  };

  // -- the token ---------------------------------------------------------------
  // A token given as #token=... in the address is moved to sessionStorage and
  // removed from the address bar.  A fragment never reaches the server, so it
  // is not in any access log; sessionStorage ends with the tab.

  function takeTokenFromAddress() {
    const match = /(?:^#|&)token=([^&]*)/.exec(location.hash);
    if (!match) return;
    let value = "";
    try { value = decodeURIComponent(match[1]); } catch (e) { value = match[1]; }
    page.token = value;
    try {
      sessionStorage.setItem(TOKEN_KEY, value);
    } catch (e) {
      // Storage disabled: page.token lasts until the page is reloaded.
    }
    history.replaceState(null, "", location.pathname + location.search);
  }

  function token() {
    try {
      return sessionStorage.getItem(TOKEN_KEY);
    } catch (e) {
      return null;
    }
  }

  function askForToken(refused) {
    page.waitingForToken = true;
    if (refused) {
      page.token = null;
      try { sessionStorage.removeItem(TOKEN_KEY); } catch (e) { /* nothing stored */ }
    }
    showError(refused ? "The admin token was refused." : "");
    $("token-form").hidden = false;
    $("main").hidden = true;
    setState("locked", "token needed");
    $("token-input").focus();
  }

  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token-input").value.trim();
    if (!value) return;
    try { sessionStorage.setItem(TOKEN_KEY, value); } catch (e) { /* tab-only fallback below */ }
    page.token = value;
    $("token-input").value = "";
    $("token-form").hidden = true;
    $("main").hidden = false;
    page.waitingForToken = false;
    poll();
  });

  // -- fetching ----------------------------------------------------------------

  class Unauthorized extends Error {}

  async function getJSON(path) {
    const headers = { Accept: "application/json" };
    const t = token() || page.token;
    if (t) headers.Authorization = "Bearer " + t;
    const response = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
    if (response.status === 401) throw new Unauthorized(t ? "refused" : "missing");
    if (!response.ok) throw new Error(path + " answered " + response.status);
    return response.json();
  }

  // Changes go to this listener only, as JSON, with the token the page holds: the API's own
  // rules apply (the admin token, not the read-only one; a JSON body; same origin).
  async function postJSON(path, body) {
    const headers = { Accept: "application/json", "Content-Type": "application/json" };
    const t = token() || page.token;
    if (t) headers.Authorization = "Bearer " + t;
    const response = await fetch(path, {
      method: "POST", headers, body: JSON.stringify(body), cache: "no-store", credentials: "omit",
    });
    let answer = null;
    try { answer = await response.json(); } catch (e) { answer = null; }
    if (response.status === 401) throw new Unauthorized(t ? "refused" : "missing");
    if (!response.ok) {
      const why = answer && typeof answer.error === "string" ? answer.error : "answered " + response.status;
      throw new Error(why);
    }
    return answer;
  }

  function showResult(message, failed) {
    const result = $("control-result");
    result.textContent = message;
    result.className = failed ? "failed" : "done";
  }

  async function change(path, body, done) {
    try {
      const status = await postJSON(path, body);
      showResult(done, false);
      page.status = status;
      renderStatus(status);
      poll();
    } catch (e) {
      if (e instanceof Unauthorized) {
        askForToken(e.message === "refused");
        return;
      }
      showResult(path + " refused: " + e.message, true);
    }
  }

  $("yield-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const source = $("hold-source").value.trim();
    const minutes = Number($("hold-lease").value);
    const body = { source, reason: $("hold-reason").value, for_seconds: Math.round(minutes * 60) };
    const upstream = $("hold-upstream").value;
    if (upstream) body.upstream = upstream;
    change("yield", body, "Yielded: " + source + " holds " + (upstream || "the GPU") + " for " + duration(minutes * 60) + ".");
  });

  function resumeButton(hold) {
    const button = el("button", "resume", "Resume");
    button.type = "button";
    button.dataset.source = hold.source;
    button.addEventListener("click", () => {
      const body = { source: hold.source };
      if (hold.upstream != null) body.upstream = hold.upstream;
      change("resume", body, "Resumed: " + hold.source + " holds " + (hold.upstream == null ? "nothing" : "no longer " + hold.upstream) + ".");
    });
    return button;
  }

  async function poll() {
    clearTimeout(page.timer);
    if (page.waitingForToken) return;
    try {
      const since = page.lastT === null ? "" : "?since=" + encodeURIComponent(page.lastT);
      const [status, hist, parked] = await Promise.all([
        getJSON("status"), getJSON("history" + since), getJSON("parked?limit=" + WAITING_SHOWN),
      ]);
      showError("");
      addHistory(hist);
      renderLost(hist.lost);
      renderLegend();
      page.status = status;
      page.startedAt = status.started_at;
      renderStatus(status);
      renderWaiting(parked);
      renderChart();
    } catch (e) {
      if (e instanceof Unauthorized) {
        askForToken(e.message === "refused");
        return;
      }
      showError("Cannot reach yieldproxy's admin listener (" + e.message + "); retrying.");
      setState("unknown", "no answer");
    }
    page.timer = setTimeout(poll, POLL_MS);
  }

  function addHistory(hist) {
    page.interval = hist.interval || 1;
    page.capacity = hist.capacity || 3600;
    page.classes = hist.classes && hist.classes.length ? hist.classes : CLASS_ORDER.slice();
    page.upstreams = hist.upstreams || [];
    page.serverNow = hist.now;
    const offset = hist.wall_offset || 0;
    // The server keeps its offset until the wall clock steps (clock.py): any change is a step.
    const stepped = page.wallOffset !== null && offset !== page.wallOffset;
    page.wallOffset = offset;
    if (page.lastT !== null && (stepped || hist.now < page.lastT - 5)) {
      // The server's wall clock stepped (every t moved with it), its clock went back, or another
      // proxy answers here: start over.
      page.samples = [];
      page.lastT = null;
      return;
    }
    for (const sample of hist.samples) {
      if (page.lastT === null || sample.t > page.lastT) page.samples.push(sample);
    }
    if (page.samples.length) page.lastT = page.samples[page.samples.length - 1].t;
    const excess = page.samples.length - page.capacity;
    if (excess > 0) page.samples.splice(0, excess);
  }

  // -- the numbers -------------------------------------------------------------

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function showError(message) {
    $("error").textContent = message;
    $("error").hidden = !message;
  }

  function setState(name, detail) {
    const badge = $("state");
    badge.textContent = name;
    badge.className = "state state-" + name;
    badge.dataset.state = name;
    $("state-detail").textContent = detail || "";
    document.title = name + " · yieldproxy";
  }

  function duration(seconds) {
    seconds = Math.max(0, Math.round(seconds));
    if (seconds < 60) return seconds + " s";
    const m = Math.floor(seconds / 60);
    if (m < 60) return m + " min " + (seconds % 60) + " s";
    const h = Math.floor(m / 60);
    return h + " h " + (m % 60) + " min";
  }

  function bytes(n) {
    if (n < 1024) return n + " B";
    const units = ["KiB", "MiB", "GiB"];
    let value = n / 1024;
    let i = 0;
    while (value >= 1024 && i < units.length - 1) { value /= 1024; i++; }
    return value.toFixed(value < 10 ? 1 : 0) + " " + units[i];
  }

  function clock(t) {
    const d = new Date(t * 1000);
    const two = (n) => String(n).padStart(2, "0");
    return two(d.getHours()) + ":" + two(d.getMinutes()) + ":" + two(d.getSeconds());
  }

  function renderStatus(status) {
    const now = status.now;
    const holds = status.holds || [];
    let detail = "";
    if (status.state === "yielded") {
      const sources = holds.map((h) => h.source).join(", ");
      detail = "held by " + sources;
    } else if (status.state === "draining") {
      detail = "replaying parked requests";
    } else if (status.state === "unreachable") {
      detail = "the upstream has not answered since the proxy started";
    } else {
      detail = "requests go straight to the upstream";
    }
    const upstreams = status.upstreams || [];
    const away = upstreams.filter((u) => u.state !== "available").map((u) => u.name + " " + u.state);
    if (upstreams.length > 1 && away.length && status.state !== "yielded") {
      detail += " (" + away.join(", ") + ")";
    }
    setState(status.state, detail);
    $("summary").hidden = true; // the static first view (admin/api.py first_view): the cards say it all now
    $("updated").textContent = "updated " + clock(now) + " · version " + status.version;

    const parked = $("parked");
    parked.replaceChildren();
    const names = Object.keys(status.parked);
    names.sort((a, b) => CLASS_ORDER.indexOf(a) - CLASS_ORDER.indexOf(b));
    for (const cls of names) {
      const box = el("div", "parked-class");
      box.id = "parked-" + cls;
      box.dataset.count = String(status.parked[cls]);
      const name = el("div", "name");
      name.append(el("span", "swatch swatch-" + cls), document.createTextNode(cls));
      box.append(el("div", "count", String(status.parked[cls])), name);
      parked.append(box);
    }
    $("inflight").textContent = String(status.inflight);
    $("parked-bytes").textContent = bytes(status.parked_bytes);
    $("expected").textContent =
      status.expected_remaining_seconds == null
        ? (status.state === "yielded" ? "unknown" : "–")
        : "in " + duration(status.expected_remaining_seconds);

    const body = $("holds-body");
    body.replaceChildren();
    for (const hold of holds) {
      const row = el("tr", "hold");
      row.dataset.source = hold.source;
      row.append(
        el("td", "source", hold.source),
        el("td", "hold-upstream", hold.upstream == null ? "all" : hold.upstream),
        el("td", "reason", hold.reason || "—"),
        el("td", "num age", duration(now - hold.since)),
        el("td", "num expiry", hold.expires_at == null ? "no lease" : "in " + duration(hold.expires_at - now)),
        el("td", "num expected", hold.expected_end == null ? "—" : "in " + duration(hold.expected_end - now)),
      );
      const action = el("td", "action");
      action.append(resumeButton(hold));
      row.append(action);
      body.append(row);
    }
    $("holds").hidden = holds.length === 0;
    $("no-holds").hidden = holds.length !== 0;
    renderRestored(holds, now);
    renderUpstreams(status.upstreams || []);
    renderFailing(status.upstreams || [], now);
  }

  // Holds older than this process: the holds file kept them across a restart (or a reload handed them
  // over). Someone who restarted the proxy to reset it finds it still yielded: say so, and how to end each.
  function renderRestored(holds, now) {
    const box = $("restored");
    box.replaceChildren();
    const kept = holds.filter((h) => h.restored);
    box.hidden = kept.length === 0;
    if (!kept.length) return;
    box.append(el("strong", "", "Kept from before the proxy started: "
      + (kept.length === 1 ? "a hold yields" : kept.length + " holds yield") + " the GPU until it ends."));
    for (const hold of kept) {
      const line = el("p", "restored-hold");
      line.dataset.source = hold.source;
      const where = hold.upstream == null ? "the GPU" : hold.upstream;
      const lease = hold.expires_at == null ? "no lease: it stays until resumed" : "its lease ends in " + duration(hold.expires_at - now);
      line.append(
        document.createTextNode(hold.source + " holds " + where + " since " + clock(hold.since) + " ("
          + (hold.reason || "no reason given") + "; " + lease + "). End it: "),
        el("code", "resume-command", "yieldproxy resume --source " + hold.source
          + (hold.upstream == null ? "" : " --upstream " + hold.upstream)),
        document.createTextNode(" or Resume below."),
      );
      box.append(line);
    }
  }

  // Who waits: the first parked requests in arrival order (GET /parked), and how many more.
  function renderWaiting(parked) {
    const body = $("waiting-body");
    body.replaceChildren();
    const rows = parked.parked || [];
    $("waiting-section").hidden = parked.total === 0;
    const upstreams = (page.status && page.status.upstreams) || [];
    for (const p of rows) {
      const row = el("tr", "parked-request");
      row.dataset.position = String(p.position);
      row.dataset.class = p.class;
      const bound = duration(p.bound_seconds) + (p.bound_by === "X-Yield-Max-Wait" ? " (X-Yield-Max-Wait)" : " (hold bound)");
      const cls = el("td", "class");
      cls.append(el("span", "swatch swatch-" + p.class), document.createTextNode(" " + p.class));
      row.append(
        el("td", "num position", p.position + (p.class_position !== p.position ? " (" + p.class_position + ")" : "")),
        cls,
        el("td", "route", p.route || "—"),
        el("td", "model", p.model || "—"),
        el("td", "upstream", upstreams.length > 1 ? p.upstreams.join(", ") : "the upstream"),
        el("td", "client", p.client || "—"),
        el("td", "num waited", duration(p.waited_seconds)),
        el("td", "num bound", bound),
        el("td", "num left", duration(p.remaining_seconds)),
      );
      body.append(row);
    }
    const more = parked.total - rows.length;
    $("waiting-more").hidden = more <= 0;
    $("waiting-more").dataset.more = String(Math.max(0, more));
    $("waiting-more").textContent = more > 0 ? "and " + more + " more" : "";
  }

  // The models judged to fail alone on each upstream (no outage: its own callers get its errors).
  function renderFailing(upstreams, now) {
    const body = $("failing-body");
    body.replaceChildren();
    let count = 0;
    for (const u of upstreams) {
      for (const f of u.failing_models || []) {
        const row = el("tr", "failing-model");
        row.dataset.model = f.model;
        row.dataset.upstream = u.name;
        row.append(
          el("td", "failing-name", f.name),
          el("td", "failing-upstream", u.name),
          el("td", "num failing-since", duration(now - f.since) + " ago"),
          el("td", "num failing-count", String(f.failures)),
          el("td", "failing-reason", f.reason + ", " + duration(now - f.last) + " ago"),
          el("td", "failing-evidence", f.evidence),
        );
        body.append(row);
        count++;
      }
    }
    $("failing-section").hidden = count === 0;
  }

  // "model: state" for each embedding model this upstream is a twin for (not the reference).
  function twinsText(twins) {
    return Object.entries(twins || {})
      .filter(([, t]) => t && t.state !== "reference")
      .map(([model, t]) => model + ": " + t.state)
      .join(", ");
  }

  // One row per upstream of a pool; one upstream shows none (the badge says it all).
  function renderUpstreamChoice(upstreams) {
    const select = $("hold-upstream");
    const names = upstreams.map((u) => u.name);
    const have = [...select.options].slice(1).map((o) => o.value);
    $("hold-upstream-label").hidden = names.length < 2;
    if (have.join("\n") === names.join("\n")) return;
    const chosen = select.value;
    select.replaceChildren(el("option", "", "all"));
    select.options[0].value = "";
    for (const name of names) {
      const option = el("option", "", name);
      option.value = name;
      select.append(option);
    }
    select.value = names.includes(chosen) ? chosen : "";
  }

  // Expired and refused requests per class over the history the proxy keeps (the last hour).
  function renderLost(lost) {
    const body = $("lost-body");
    body.replaceChildren();
    if (!lost) return;
    $("lost-window").textContent = lost.since == null ? "" : "since " + clock(lost.since);
    const names = Object.keys(lost.expired || {});
    names.sort((a, b) => CLASS_ORDER.indexOf(a) - CLASS_ORDER.indexOf(b));
    for (const cls of names) {
      const row = el("tr", "lost");
      row.dataset.class = cls;
      const expired = (lost.expired || {})[cls] || 0;
      const refused = (lost.rejected || {})[cls] || 0;
      row.dataset.expired = String(expired);
      row.dataset.rejected = String(refused);
      const name = el("td", "name");
      name.append(el("span", "swatch swatch-" + cls), document.createTextNode(" " + cls));
      const expiredCell = el("td", "num expired" + (expired ? " nonzero" : ""), String(expired));
      expiredCell.title = "expired while parked";
      const refusedCell = el("td", "num rejected" + (refused ? " nonzero" : ""), String(refused));
      refusedCell.title = "refused at once";
      row.append(name, expiredCell, refusedCell);
      body.append(row);
    }
  }

  function renderUpstreams(upstreams) {
    renderUpstreamChoice(upstreams);
    const body = $("upstreams-body");
    body.replaceChildren();
    $("upstreams-section").hidden = upstreams.length < 2;
    for (const u of upstreams) {
      const row = el("tr", "upstream");
      row.dataset.upstream = u.name;
      row.dataset.state = u.state;
      const state = el("td", "upstream-state");
      state.append(el("span", "state state-" + u.state, u.state));
      const holders = [...new Set((u.holds || []).map((h) => h.source))].join(", ");
      row.append(
        el("td", "name", u.name),
        state,
        el("td", "use", u.use === "when_others_yielded" ? "standby" : "always"),
        el("td", "held-by", holders || "—"),
        el("td", "num inflight", String(u.inflight)),
        el("td", "num waiting", String(u.waiting)),
        el("td", "models", (u.models || []).join(", ") || "—"),
        el("td", "twins", twinsText(u.twins) || "—"),
      );
      body.append(row);
    }
  }

  // -- the chart ---------------------------------------------------------------

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // The smallest step of 1, 2 or 5 times a power of ten that needs at most
  // five gridlines above zero; the scale ends on a gridline, at 4 or more.
  function yScale(top) {
    let step = 1;
    for (let power = 1; ; power *= 10) {
      step = [1, 2, 5].map((f) => f * power).find((s) => top / s <= 5);
      if (step) break;
    }
    return { step, max: Math.max(4, Math.ceil(top / step) * step) };
  }

  function timeTicks(t0, t1) {
    const span = t1 - t0;
    const steps = [10, 15, 30, 60, 120, 300, 600, 900, 1800];
    const step = steps.find((s) => span / s <= 7) || 3600;
    const ticks = [];
    for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) ticks.push(t);
    return { ticks, step };
  }

  // Runs of samples in one state: [start, end) where end is the next sample's
  // t (or now).  A gap of several intervals (sampler stopped, proxy restarted)
  // ends a run, so an old yield is not stretched over time nobody saw.
  function runs(samples, state, now, gap) {
    const out = [];
    let start = null;
    let prev = null;
    for (const s of samples) {
      const broken = prev !== null && s.t - prev.t > gap;
      if (start !== null && (s.state !== state || broken)) {
        out.push([start, broken ? prev.t + page.interval : s.t]);
        start = null;
      }
      if (s.state === state && start === null) start = s.t;
      prev = s;
    }
    if (start !== null) out.push([start, now]);
    return out;
  }

  // Runs of equal values of read(sample): [value, start, end), broken at gaps as runs() does.
  function stateRuns(samples, read, now, gap) {
    const out = [];
    let current = null;
    let prev = null;
    for (const s of samples) {
      const value = read(s);
      const broken = prev !== null && s.t - prev.t > gap;
      if (current !== null && (value !== current[0] || broken)) {
        current[2] = broken ? prev.t + page.interval : s.t;
        out.push(current);
        current = null;
      }
      if (current === null) current = [value, s.t, null];
      prev = s;
    }
    if (current !== null) {
      current[2] = now;
      out.push(current);
    }
    return out;
  }

  function renderLegend() {
    const legend = $("legend");
    legend.replaceChildren();
    const item = (swatch, label) => {
      const li = el("li");
      li.append(el("span", "swatch " + swatch), document.createTextNode(label));
      legend.append(li);
    };
    for (const cls of page.classes) item("swatch-" + cls, cls);
    item("swatch-inflight", "in flight");
    item("swatch-yield", "yielded");
    item("swatch-drain", "draining");
  }

  function renderChart() {
    const chart = $("chart");
    const width = Math.max(320, Math.round(chart.getBoundingClientRect().width || 900));
    const STRIP = 16;
    const strips = page.upstreams.length ? 8 + STRIP * page.upstreams.length : 0;
    const height = 300 + strips;
    // Room on the left for the strips' labels ("upstream", or a member's name) when there are strips.
    const m = { left: strips ? 64 : 44, right: 14, top: 12, bottom: 26 + strips };
    const w = width - m.left - m.right;
    const h = height - m.top - m.bottom;
    chart.setAttribute("viewBox", "0 0 " + width + " " + height);
    chart.setAttribute("width", width);
    chart.setAttribute("height", height);
    chart.replaceChildren();

    const now = page.serverNow;
    const samples = page.samples;
    const windowSeconds = Number($("window").value);
    const first = samples.length ? samples[0].t : now;
    // The axis starts at the window's start, but not before the proxy started (or its oldest sample, if
    // that is older): no stretch of time drawn that the proxy never saw.
    const began = Math.min(first, page.startedAt == null ? first : page.startedAt);
    const t0 = Math.max(now - windowSeconds, Math.min(began, now - 1));
    const span = now - t0;
    chart.dataset.t0 = String(t0);
    const visible = samples.filter((s) => s.t >= t0 - page.interval);
    chart.dataset.samples = String(visible.length);

    let top = 0;
    for (const s of visible) {
      for (const cls of page.classes) top = Math.max(top, s.parked[cls] || 0);
      top = Math.max(top, s.inflight);
    }
    const { step: yStep, max: yMax } = yScale(top);
    const x = (t) => m.left + ((Math.max(t, t0) - t0) / span) * w;
    const y = (v) => m.top + h - (v / yMax) * h;
    const gap = Math.max(3 * page.interval, 3);

    // Bands first, so the lines are drawn over them.
    const bands = svg("g", { id: "yield-bands" });
    for (const [state, cls] of [["yielded", "yield-band"], ["draining", "drain-band"]]) {
      for (const [a, b] of runs(visible, state, now, gap)) {
        if (b < t0) continue;
        const rect = svg("rect", {
          class: cls,
          x: x(a).toFixed(1),
          y: m.top,
          width: Math.max(1, x(b) - x(a)).toFixed(1),
          height: h,
          "data-start": a,
          "data-end": b,
        });
        rect.append(svg("title", {}, state + " " + clock(a) + " – " + clock(b) + " (" + duration(b - a) + ")"));
        bands.append(rect);
      }
    }
    chart.append(bands);

    const grid = svg("g", { id: "grid" });
    for (let v = 0; v <= yMax; v += yStep) {
      grid.append(svg("line", { class: v === 0 ? "axis" : "grid", x1: m.left, x2: m.left + w, y1: y(v), y2: y(v) }));
      grid.append(svg("text", { class: "tick", x: m.left - 6, y: y(v) + 4, "text-anchor": "end" }, String(v)));
    }
    const { ticks } = timeTicks(t0, now);
    for (const t of ticks) {
      grid.append(svg("line", { class: "grid", x1: x(t), x2: x(t), y1: m.top, y2: m.top + h }));
      grid.append(svg("text", { class: "tick", x: x(t), y: m.top + h + 18, "text-anchor": "middle" }, clock(t).slice(0, span > 900 ? 5 : 8)));
    }
    grid.append(svg("line", { class: "now-line", x1: x(now), x2: x(now), y1: m.top, y2: m.top + h }));
    chart.append(grid);

    // Levels hold until the next sample: step lines, broken at gaps.
    const stepPath = (read) => {
      let d = "";
      let prev = null;
      for (const s of visible) {
        const px = x(s.t).toFixed(1);
        const py = y(read(s)).toFixed(1);
        if (prev === null || s.t - prev.t > gap) d += "M" + px + " " + py;
        else d += "H" + px + "V" + py;
        prev = s;
      }
      if (prev !== null) d += "H" + x(Math.min(now, prev.t + gap)).toFixed(1);
      return d;
    };
    const lines = svg("g", { id: "lines" });
    for (const cls of page.classes) {
      lines.append(svg("path", {
        id: "parked-" + cls + "-line",
        class: "parked-line class-" + cls,
        "data-class": cls,
        "data-max": Math.max(0, ...visible.map((s) => s.parked[cls] || 0)),
        d: stepPath((s) => s.parked[cls] || 0),
      }));
    }
    // In flight last, on top: at zero every line lies on the axis, and its dashes stay visible over them.
    lines.append(svg("path", {
      id: "inflight-line", class: "inflight-line", d: stepPath((s) => s.inflight),
      "data-max": Math.max(0, ...visible.map((s) => s.inflight)),
    }));
    chart.append(lines);

    // Each upstream's state over time: one strip each, under the time axis.
    const states = svg("g", { id: "upstream-strips" });
    // One upstream (proxy.upstream) is the member named "default": its strip says "upstream".
    const single = page.upstreams.length === 1 && page.upstreams[0] === "default";
    page.upstreams.forEach((name, i) => {
      const top = m.top + h + 26 + i * STRIP;
      const row = svg("g", { class: "upstream-strip", "data-upstream": name });
      const label = svg("text", { class: "tick strip-name", x: m.left - 6, y: top + 10, "text-anchor": "end" },
        single ? "upstream" : name.slice(0, 8));
      label.append(svg("title", {}, single ? "the upstream (proxy.upstream): its state over time"
        : "upstream " + name + ": its state over time"));
      row.append(label);
      for (const [state, a, b] of stateRuns(visible, (s) => (s.upstreams || {})[name], now, gap)) {
        if (b < t0 || state === undefined) continue;
        const rect = svg("rect", {
          class: "upstream-band band-" + state, "data-state": state, "data-start": a, "data-end": b,
          x: x(a).toFixed(1), y: top, width: Math.max(1, x(b) - x(a)).toFixed(1), height: STRIP - 4,
        });
        rect.append(svg("title", {}, name + " " + state + " " + clock(a) + " – " + clock(b) + " (" + duration(b - a) + ")"));
        row.append(rect);
      }
      states.append(row);
    });
    chart.append(states);

    if (!visible.length) {
      chart.append(svg("text", { class: "empty", x: m.left + w / 2, y: m.top + h / 2, "text-anchor": "middle" },
        "no samples yet"));
    }
  }

  // -- start ---------------------------------------------------------------------

  takeTokenFromAddress();
  $("window").addEventListener("change", renderChart);
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { if (page.serverNow !== null) renderChart(); }, 150);
  });
  poll();
})();
