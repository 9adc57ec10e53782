/* The chat page of `k3kit serve`: talks to this server only, over its OpenAI routes.
 *
 * Replies stream from POST /v1/chat/completions (server-sent events, with usage at the end);
 * Stop aborts the fetch, which the server sees as a disconnect and cancels the sequence. The
 * panel reads GET /v1/k3kit/stats, the figures /metrics exports, and plots the last minutes from
 * the history the server keeps. Conversations, settings and the API key live in localStorage.
 * Every figure shown keeps its raw value in data-value, for people who inspect and for tests.
 */
(function () {
  "use strict";

  var LS = { convs: "k3kit.conversations", current: "k3kit.current", key: "k3kit.apiKey",
             settings: "k3kit.settings" };
  var DEFAULTS = { system: "", temperature: 0.7, top_p: 1, max_tokens: 512, seed: "", draft: true };
  var POLL_MS = 2000;
  var PLOT_SECONDS = 300;
  var RATE_WINDOW = 5;        // s over which a plotted rate is taken

  var $ = function (id) { return document.getElementById(id); };
  var md = window.K3Markdown;

  function load(key, fallback) {
    try {
      var v = JSON.parse(localStorage.getItem(key));
      return v === null || v === undefined ? fallback : v;
    } catch (e) { return fallback; }
  }
  function store(key, value) { localStorage.setItem(key, JSON.stringify(value)); }

  var convs = load(LS.convs, []);
  var currentId = localStorage.getItem(LS.current);
  var settings = Object.assign({}, DEFAULTS, load(LS.settings, {}));
  var server = { model: null, draft: false, loaded: false };
  var busy = null;            // {controller, msg} while a reply streams
  var authRequired = document.documentElement.getAttribute("data-auth") === "required";

  // -- API key ----------------------------------------------------------------------------------
  var keyWaiters = [];
  function askKey(message) {
    $("key-message").textContent = message;
    $("key-overlay").hidden = false;
    $("key-input").value = "";
    $("key-input").focus();
    return new Promise(function (resolve) { keyWaiters.push(resolve); });
  }
  function saveKey() {
    var k = $("key-input").value.trim();
    if (!k) return;
    localStorage.setItem(LS.key, k);
    $("key-overlay").hidden = true;
    $("forget-key").hidden = false;
    var w = keyWaiters; keyWaiters = [];
    w.forEach(function (f) { f(k); });
  }

  // fetch on this origin with the key; a 401 asks for a key and tries again
  async function api(path, options) {
    for (;;) {
      var key = localStorage.getItem(LS.key);
      if (authRequired && !key) {
        await askKey("This server needs an API key.");
        continue;
      }
      var opts = Object.assign({}, options || {});
      opts.headers = Object.assign({}, opts.headers || {});
      if (key) opts.headers.Authorization = "Bearer " + key;
      var resp = await fetch(path, opts);
      if (resp.status !== 401) return resp;
      localStorage.removeItem(LS.key);
      authRequired = true;
      await askKey("The server refused the key. Enter the server's API key.");
    }
  }

  // -- conversations ----------------------------------------------------------------------------
  function current() {
    var c = convs.find(function (x) { return x.id === currentId; });
    if (!c) {
      c = { id: String(Date.now()) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
      convs.unshift(c);
      currentId = c.id;
      saveConvs();
    }
    return c;
  }
  function saveConvs() {
    store(LS.convs, convs);
    localStorage.setItem(LS.current, currentId || "");
  }
  function newChat() {
    if (busy) return;
    var c = convs.find(function (x) { return x.id === currentId; });
    if (c && c.messages.length === 0) { $("input").focus(); return; }
    currentId = null;
    current();
    renderAll();
    $("input").focus();
  }

  function renderConversations() {
    var nav = $("conversations");
    nav.textContent = "";
    convs.forEach(function (c) {
      var item = document.createElement("div");
      item.className = "conv" + (c.id === currentId ? " active" : "");
      item.dataset.id = c.id;
      var t = document.createElement("span");
      t.className = "conv-title";
      t.textContent = c.title || "New chat";
      var del = document.createElement("button");
      del.type = "button";
      del.className = "conv-del";
      del.title = "delete this conversation";
      del.textContent = "×";
      item.appendChild(t);
      item.appendChild(del);
      nav.appendChild(item);
    });
  }

  // -- messages ---------------------------------------------------------------------------------
  function fmt(n, digits) { return Number(n).toFixed(digits); }
  function fmtMs(ms) { return ms < 1000 ? fmt(ms, 0) + " ms" : fmt(ms / 1000, 2) + " s"; }
  function fmtBytes(b) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
    return (i ? fmt(b, b < 10 ? 2 : 1) : fmt(b, 0)) + " " + units[i];
  }

  function assistantHtml(m) {
    var html = "";
    if (m.reasoning) {
      html += '<details class="reasoning"><summary>Reasoning</summary><div class="md">' +
        md.render(m.reasoning) + "</div></details>";
    }
    html += '<div class="md content">' + md.render(m.content) + "</div>";
    (m.tool_calls || []).forEach(function (tc) {
      var f = tc.function || {};
      html += '<div class="tool-call"><span class="tool-label">tool call</span><code><span class="fn">' +
        md.escapeHtml(f.name || "?") + "</span>(" + md.escapeHtml(f.arguments || "") + ")</code></div>";
    });
    if (m.state === "streaming" && !m.content && !m.reasoning) html += '<div class="typing"><i></i><i></i><i></i></div>';
    if (m.error) html += '<div class="error">' + md.escapeHtml(m.error) + "</div>";
    var s = m.stats;
    if (s && m.state !== "streaming") {
      var bits = [];
      if (s.ttft_ms !== null && s.ttft_ms !== undefined) bits.push("TTFT " + fmtMs(s.ttft_ms));
      if (s.tok_s) bits.push(fmt(s.tok_s, 1) + " tok/s");
      if (s.completion_tokens !== null && s.completion_tokens !== undefined) bits.push(s.completion_tokens + " tokens");
      bits.push(m.state === "stopped" ? "stopped" : (m.finish || m.state));
      html += '<div class="meta">' + md.escapeHtml(bits.join(" · ")) + "</div>";
    }
    return html;
  }

  function messageEl(m, index) {
    var el = document.createElement("div");
    el.className = "msg " + m.role;
    el.dataset.index = String(index);
    if (m.state) el.dataset.state = m.state;
    var body = document.createElement("div");
    body.className = "bubble";
    if (m.role === "assistant") body.innerHTML = assistantHtml(m);
    else body.textContent = m.content;
    el.appendChild(body);
    return el;
  }

  function nearBottom() {
    var box = $("messages");
    return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  }

  function renderMessages() {
    var box = $("messages");
    var c = current();
    box.textContent = "";
    if (!c.messages.length) {
      var empty = document.createElement("div");
      empty.className = "empty";
      empty.innerHTML = "<h1>k3kit</h1><p>Ask the model something. Replies stream as they are " +
        "decoded; the panel on the right shows what the engine does meanwhile.</p>";
      box.appendChild(empty);
      return;
    }
    c.messages.forEach(function (m, i) { box.appendChild(messageEl(m, i)); });
    box.scrollTop = box.scrollHeight;
  }

  var pending = null;
  function renderStreaming(msg, index) {
    if (pending) return;
    pending = requestAnimationFrame(function () {
      pending = null;
      var el = document.querySelector('#messages .msg[data-index="' + index + '"]');
      if (!el) return;
      var stick = nearBottom();
      el.dataset.state = msg.state;
      el.firstChild.innerHTML = assistantHtml(msg);
      if (stick) $("messages").scrollTop = $("messages").scrollHeight;
    });
  }

  function renderAll() {
    renderConversations();
    renderMessages();
    renderReply(lastReply());
  }

  // -- streaming a reply ------------------------------------------------------------------------
  function mergeToolCalls(calls, deltas) {
    deltas.forEach(function (d) {
      var i = d.index === undefined ? calls.length : d.index;
      var c = calls[i] || (calls[i] = { id: d.id || "", type: "function", function: { name: "", arguments: "" } });
      if (d.id) c.id = d.id;
      var f = d.function || {};
      if (f.name) c.function.name += f.name;
      if (f.arguments) c.function.arguments += f.arguments;
    });
  }

  function requestBody(c, msg) {
    var messages = [];
    if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
    c.messages.forEach(function (m) {
      if (m === msg || m.state === "error") return;
      var out = { role: m.role, content: m.content || "" };
      if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
      messages.push(out);
    });
    var body = { messages: messages, stream: true, stream_options: { include_usage: true } };
    if (server.model) body.model = server.model;
    var t = parseFloat(settings.temperature);
    if (!isNaN(t)) body.temperature = t;
    var p = parseFloat(settings.top_p);
    if (!isNaN(p)) body.top_p = p;
    var n = parseInt(settings.max_tokens, 10);
    if (n > 0) body.max_tokens = n;
    var seed = parseInt(settings.seed, 10);
    if (!isNaN(seed) && seed >= 0) body.seed = seed;
    if (server.draft && !settings.draft) body.draft = false;       // k3kit's extension field
    return body;
  }

  async function send() {
    var text = $("input").value;
    if (!text.trim() || busy) return;
    var c = current();
    if (!c.messages.length) c.title = text.trim().split("\n")[0].slice(0, 48);
    c.messages.push({ role: "user", content: text });
    var msg = { role: "assistant", content: "", reasoning: "", tool_calls: [], state: "streaming", stats: null };
    c.messages.push(msg);
    var index = c.messages.length - 1;
    $("input").value = "";
    saveConvs();
    renderConversations();
    renderMessages();
    var controller = new AbortController();
    busy = { controller: controller, msg: msg };
    setBusy(true);
    var t0 = performance.now();
    var tFirst = null, tLast = null, pieces = 0, usage = null, timings = null;
    try {
      var resp = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(requestBody(c, msg)), signal: controller.signal });
      if (!resp.ok) {
        var err = null;
        try { err = await resp.json(); } catch (e) { err = null; }
        throw new Error((err && err.error && err.error.message) || ("HTTP " + resp.status));
      }
      var reader = resp.body.getReader();
      var decoder = new TextDecoder();
      var buf = "";
      var finished = false;
      while (!finished) {
        var r = await reader.read();
        if (r.done) break;
        buf += decoder.decode(r.value, { stream: true });
        var cut;
        while (!finished && (cut = buf.indexOf("\n\n")) >= 0) {
          var event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          event.split("\n").forEach(function (line) {
            if (finished || line.indexOf("data:") !== 0) return;
            var data = line.slice(5).trim();
            if (data === "[DONE]") { finished = true; return; }
            var obj = JSON.parse(data);
            if (obj.error) throw new Error(obj.error.message || "the server reported an error");
            if (obj.usage) usage = obj.usage;
            if (obj.timings) timings = obj.timings;
            (obj.choices || []).forEach(function (ch) {
              var d = ch.delta || {};
              if (d.content || d.reasoning_content || d.tool_calls) {
                var now = performance.now();
                if (tFirst === null) tFirst = now;
                tLast = now;
                pieces++;
              }
              if (d.content) msg.content += d.content;
              if (d.reasoning_content) msg.reasoning += d.reasoning_content;
              if (d.tool_calls) mergeToolCalls(msg.tool_calls, d.tool_calls);
              if (ch.finish_reason) msg.finish = ch.finish_reason;
            });
          });
          renderStreaming(msg, index);
        }
      }
      msg.state = "done";
    } catch (e) {
      if (e && e.name === "AbortError") msg.state = "stopped";
      else { msg.state = "error"; msg.error = String((e && e.message) || e); }
    } finally {
      var n = usage ? usage.completion_tokens : pieces;
      var cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
      msg.stats = {
        ttft_ms: tFirst === null ? null : tFirst - t0,
        // the server's own decode rate (its `timings`); else the stream's, unless the reply arrived
        // in one burst (a proxy's buffering), which has no decode speed to show
        tok_s: timings && timings.predicted_per_second ? timings.predicted_per_second
          : n > 1 && tLast - tFirst > 20 ? (n - 1) / ((tLast - tFirst) / 1000) : null,
        prompt_tokens: usage ? usage.prompt_tokens : null,
        cached_tokens: cached || 0,
        completion_tokens: n,
      };
      busy = null;
      setBusy(false);
      saveConvs();
      if (pending) { cancelAnimationFrame(pending); pending = null; }
      renderMessages();
      renderReply(msg);
      pollSoon();
    }
  }

  function stop() {
    if (busy) busy.controller.abort();
  }

  function setBusy(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    document.body.classList.toggle("busy", on);
  }

  // -- the panel --------------------------------------------------------------------------------
  function show(id, value, text) {
    var el = $(id);
    el.dataset.value = value === null || value === undefined ? "" : String(value);
    el.textContent = text;
  }

  function lastReply() {
    var c = current();
    for (var i = c.messages.length - 1; i >= 0; i--) {
      if (c.messages[i].role === "assistant" && c.messages[i].stats) return c.messages[i];
    }
    return null;
  }

  function renderReply(m) {
    var s = m ? m.stats : null;
    var has = function (v) { return v !== null && v !== undefined; };
    show("r-ttft", s && has(s.ttft_ms) ? s.ttft_ms : null, s && has(s.ttft_ms) ? fmtMs(s.ttft_ms) : "–");
    show("r-toks", s && s.tok_s ? s.tok_s : null, s && s.tok_s ? fmt(s.tok_s, 1) + " tok/s" : "–");
    show("r-prompt", s && has(s.prompt_tokens) ? s.prompt_tokens : null,
      s && has(s.prompt_tokens) ? String(s.prompt_tokens) : "–");
    show("r-cached", s ? s.cached_tokens : null, s ? String(s.cached_tokens) : "–");
    show("r-completion", s ? s.completion_tokens : null, s ? String(s.completion_tokens) : "–");
    var fin = m ? (m.state === "stopped" ? "stopped" : (m.finish || m.state)) : null;
    show("r-finish", fin, fin || "–");
  }

  function pct(x) { return fmt(100 * x, 1) + " %"; }

  function renderServer(body) {
    server.model = body.model;
    server.draft = !!body.draft;
    server.loaded = !!body.loaded;
    $("model-name").textContent = body.model + (body.loaded ? "" : " (loading…)");
    $("status-dot").className = "dot " + (body.loaded ? "ok" : "loading");
    $("draft-badge").hidden = !server.draft;
    $("draft-row").hidden = !server.draft;
    var s = body.stats, r = body.ratios;
    if (!s) return;
    show("s-active", s.active, String(s.active));
    show("s-queue", s.queued, s.queued + " waiting (max " + s.max_queue + ")");
    $("s-queue").dataset.capacity = String(s.max_queue);
    show("s-batch", s.batch_rows, s.batch_rows + " rows, " + s.batch_sequences + " seq");
    $("s-batch").dataset.sequences = String(s.batch_sequences);
    var looked = s.expert_hits + s.expert_misses;
    show("s-hit-rate", r.expert_cache_hit_rate, looked ? pct(r.expert_cache_hit_rate) : "no lookups yet");
    show("s-payload", r.expert_payload_bytes_per_token, fmtBytes(r.expert_payload_bytes_per_token));
    show("s-committed", r.speculative_committed_per_pass,
      s.spec_passes ? fmt(r.speculative_committed_per_pass, 2) : (server.draft ? "no passes yet" : "no draft"));
    show("s-acceptance", r.speculative_acceptance,
      s.spec_proposed ? pct(r.speculative_acceptance) : (server.draft ? "no proposals yet" : "no draft"));
    show("s-generated", s.generated_tokens, String(s.generated_tokens));
    drawPlots(body.history || [], body.time);
    var upd = $("updated");
    upd.dataset.time = String(body.time);
    upd.textContent = "updated " + new Date(body.time * 1000).toLocaleTimeString();
  }

  // rates over RATE_WINDOW seconds from the counters' history: [[t, value|null]]
  function series(history, value) {
    var out = [];
    var j = 0;
    for (var i = 1; i < history.length; i++) {
      var b = history[i];
      while (j < i - 1 && b.t - history[j + 1].t >= RATE_WINDOW) j++;
      var a = history[j];
      if (b.t - a.t <= 0) continue;
      out.push([b.t, value(a, b)]);
    }
    return out;
  }

  function drawPlot(svgId, points, now, fixedMax, label) {
    var svg = $(svgId);
    var W = 260, H = 64, pad = 4;
    var vals = points.map(function (p) { return p[1]; }).filter(function (v) { return v !== null; });
    var max = fixedMax || Math.max(1, Math.max.apply(null, vals.concat([0])) * 1.15);
    var x = function (t) { return W - (now - t) / PLOT_SECONDS * W; };
    var y = function (v) { return H - pad - (v / max) * (H - 2 * pad); };
    var parts = [];
    for (var g = 1; g < 4; g++) {
      parts.push('<line class="grid" x1="0" x2="' + W + '" y1="' + (pad + g * (H - 2 * pad) / 4) +
        '" y2="' + (pad + g * (H - 2 * pad) / 4) + '"/>');
    }
    var segs = [], seg = [];
    points.forEach(function (p) {
      if (p[1] === null || x(p[0]) < 0) { if (seg.length) segs.push(seg); seg = []; return; }
      seg.push(fmt(x(p[0]), 1) + "," + fmt(y(p[1]), 1));
    });
    if (seg.length) segs.push(seg);
    segs.forEach(function (s) {
      if (s.length === 1) {
        var xy = s[0].split(",");
        parts.push('<circle class="pt" cx="' + xy[0] + '" cy="' + xy[1] + '" r="1.8"/>');
      } else {
        parts.push('<polyline class="area" points="' + s[0].split(",")[0] + "," + (H - pad) + " " + s.join(" ") +
          " " + s[s.length - 1].split(",")[0] + "," + (H - pad) + '"/>');
        parts.push('<polyline class="line" points="' + s.join(" ") + '"/>');
      }
    });
    parts.push('<text x="3" y="11" class="axis">' + md.escapeHtml(label(max)) + "</text>");
    parts.push('<text x="3" y="' + (H - 6) + '" class="axis">5 min</text>');
    svg.innerHTML = parts.join("");
    svg.dataset.points = String(vals.length);
  }

  function drawPlots(history, now) {
    var toks = series(history, function (a, b) { return (b.generated_tokens - a.generated_tokens) / (b.t - a.t); });
    var hits = series(history, function (a, b) {
      var h = b.expert_hits - a.expert_hits, l = h + b.expert_misses - a.expert_misses;
      return l > 0 ? h / l : null;
    });
    drawPlot("plot-toks", toks, now, 0, function (m) { return "max " + fmt(m, m < 10 ? 1 : 0); });
    drawPlot("plot-hit", hits, now, 1, function () { return "100 %"; });
    var lastT = toks.length ? toks[toks.length - 1][1] : null;
    $("p-toks-now").textContent = lastT === null ? "" : fmt(lastT, 1);
    var lastH = null;
    for (var i = hits.length - 1; i >= 0; i--) { if (hits[i][1] !== null) { lastH = hits[i][1]; break; } }
    $("p-hit-now").textContent = lastH === null ? "" : pct(lastH);
  }

  var pollTimer = null;
  async function poll() {
    clearTimeout(pollTimer);
    try {
      var resp = await api("/v1/k3kit/stats");
      if (resp.ok) renderServer(await resp.json());
    } catch (e) {
      $("status-dot").className = "dot down";
      $("model-name").textContent = "server unreachable";
    }
    pollTimer = setTimeout(poll, POLL_MS);
  }
  function pollSoon() { clearTimeout(pollTimer); pollTimer = setTimeout(poll, 150); }

  // -- settings ---------------------------------------------------------------------------------
  var FIELDS = { "set-system": "system", "set-temperature": "temperature", "set-top-p": "top_p",
                 "set-max-tokens": "max_tokens", "set-seed": "seed" };
  function bindSettings() {
    Object.keys(FIELDS).forEach(function (id) {
      var el = $(id), name = FIELDS[id];
      el.value = settings[name];
      el.addEventListener("input", function () { settings[name] = el.value; store(LS.settings, settings); });
    });
    $("set-draft").checked = settings.draft !== false;
    $("set-draft").addEventListener("change", function () {
      settings.draft = $("set-draft").checked;
      store(LS.settings, settings);
    });
  }

  // -- wiring -----------------------------------------------------------------------------------
  function init() {
    bindSettings();
    $("forget-key").hidden = !localStorage.getItem(LS.key);
    $("send").addEventListener("click", send);
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", newChat);
    $("key-save").addEventListener("click", saveKey);
    $("key-input").addEventListener("keydown", function (e) { if (e.key === "Enter") saveKey(); });
    $("forget-key").addEventListener("click", function () {
      localStorage.removeItem(LS.key);
      $("forget-key").hidden = true;
    });
    $("input").addEventListener("keydown", function (e) {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    });
    $("conversations").addEventListener("click", function (e) {
      var item = e.target.closest(".conv");
      if (!item || busy) return;
      if (e.target.classList.contains("conv-del")) {
        convs = convs.filter(function (c) { return c.id !== item.dataset.id; });
        if (currentId === item.dataset.id) currentId = convs.length ? convs[0].id : null;
      } else {
        currentId = item.dataset.id;
      }
      current();
      saveConvs();
      renderAll();
    });
    $("messages").addEventListener("click", function (e) {
      if (!e.target.classList.contains("copy")) return;
      var code = e.target.closest(".code").querySelector("code").textContent;
      if (navigator.clipboard) {
        navigator.clipboard.writeText(code).then(function () { e.target.textContent = "copied"; },
          function () { e.target.textContent = "copy failed"; });
      }
    });
    // a reply that was streaming when the page went away is kept as stopped
    convs.forEach(function (c) {
      c.messages.forEach(function (m) { if (m.state === "streaming") m.state = "stopped"; });
    });
    current();
    saveConvs();
    renderAll();
    $("input").focus();
    poll();
  }

  window.addEventListener("DOMContentLoaded", init);
})();
