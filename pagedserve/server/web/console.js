// pagedserve web console: a playground over /v1/chat/completions and /v1/completions (streamed
// with fetch + ReadableStream; chat with tools: the calls the model makes, and their results
// typed in as role "tool" messages), and a monitor over /device, /device/pages and /metrics.
// No library and no build step; every URL is relative, so the page works behind a path prefix.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pagedserve.apiKey";
const CHAT_STORE = "pagedserve.conversation";
const STATES = ["free", "cached", "used", "shared"]; // page-map digits 0..3 (PAGE_STATES)
const HOST_STATES = ["free", "cached", "swapped"]; // the host tier's digits (HOST_PAGE_STATES)

// ---- the server ---------------------------------------------------------------------------------
function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function api(path, options = {}) {
  const headers = { ...authHeaders(), ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401 && $("notice").hidden) {
    notice("This server needs an API key: type its --api-key in the API key field.");
    $("api-key").focus(); // once, not on every refresh of the monitor
  }
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || body.detail || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// The /v1/models request out now. A key typed or cleared sends a new one and aborts this one, so
// that only the answer to the key the field holds is shown: answers may come back out of order.
let modelsRequest = null;

async function loadModelName() {
  modelsRequest?.abort();
  const request = (modelsRequest = new AbortController());
  const keyless = !$("api-key").value.trim(); // as sent: the field may change before the answer
  try {
    const models = await (await api("v1/models", { signal: request.signal })).json();
    state.model = models.data[0].id;
    $("model-name").textContent = state.model;
    renderModelChoice(models.data.map((m) => m.id));
    notice("");
    // answered a request sent without a key: this server has none, so the field would only
    // confuse (a key typed or cleared while an earlier request was out says nothing of that)
    if (keyless && !$("api-key").value.trim()) $("key-label").hidden = true;
  } catch {
    if (!request.signal.aborted) $("model-name").textContent = "";
  }
}

// The base model and its LoRA adapters (a server with --enable-lora lists them): the playground
// sends the one chosen as the request's model.
function renderModelChoice(ids) {
  const select = $("model-select");
  const chosen = ids.includes(select.value) ? select.value : ids[0];
  select.replaceChildren(...ids.map((id) => new Option(id, id, false, id === chosen)));
  state.model = chosen;
  $("model-label").hidden = ids.length < 2;
}

// ---- tabs ---------------------------------------------------------------------------------------
function selectTab(tab) {
  for (const t of document.querySelectorAll("[role=tab]")) {
    const selected = t === tab;
    t.setAttribute("aria-selected", String(selected));
    t.tabIndex = selected ? 0 : -1;
    $(t.getAttribute("aria-controls")).hidden = !selected;
  }
  tab.focus();
  if (tab.id === "tab-monitor") startMonitor();
  else stopMonitor();
}

function onTabKey(event) {
  const tabs = [...document.querySelectorAll("[role=tab]")];
  const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
  if (!step) return;
  const next = tabs[(tabs.indexOf(event.target) + step + tabs.length) % tabs.length];
  selectTab(next);
}

// ---- playground ---------------------------------------------------------------------------------
const state = { model: null, messages: [], controller: null };

function mode() {
  return document.querySelector("input[name=mode]:checked").value;
}

function addEntry(role, text, calls = []) {
  const li = document.createElement("li");
  li.className = role;
  li.innerHTML =
    '<div class="role"></div><div class="reasoning" hidden></div><div class="text"></div>' +
    '<ol class="calls" aria-label="Tool calls" hidden></ol><div class="stats"></div>';
  li.querySelector(".role").textContent = role;
  li.querySelector(".text").textContent = text ?? "";
  showCalls(li, calls);
  $("transcript").append(li);
  scrollToEnd();
  return li;
}

// A call as the model made it: the function's name and its JSON arguments.
function showCalls(entry, calls) {
  const list = entry.querySelector(".calls");
  list.replaceChildren();
  for (const call of calls) {
    const item = document.createElement("li");
    item.className = "tool-call";
    item.textContent = `${call.function.name}(${call.function.arguments})`;
    list.append(item);
  }
  list.hidden = calls.length === 0;
}

// Scrolls the transcript, not the page: at phone width the page stays where the reader is.
function scrollToEnd() {
  const transcript = $("transcript");
  transcript.scrollTop = transcript.scrollHeight;
}

function restoreConversation() {
  state.messages = JSON.parse(sessionStorage.getItem(CHAT_STORE) || "[]");
  for (const m of state.messages) addEntry(m.role, m.content, m.tool_calls || []);
  onToolsAnswered();
}

function saveConversation() {
  sessionStorage.setItem(CHAT_STORE, JSON.stringify(state.messages));
}

function clearConversation() {
  state.messages = [];
  saveConversation();
  $("transcript").replaceChildren();
  $("answer-status").textContent = "";
  onToolsAnswered();
}

// The calls of the last assistant message that no tool message answers yet.
function pendingCalls() {
  const last = state.messages.findLastIndex((m) => m.role === "assistant");
  const calls = last >= 0 ? state.messages[last].tool_calls || [] : [];
  const answered = new Set(state.messages.slice(last + 1).map((m) => m.tool_call_id));
  return calls.filter((c) => !answered.has(c.id));
}

function onToolsAnswered() {
  const next = pendingCalls()[0];
  $("prompt").placeholder = next
    ? `The result of ${next.function.name} (sent as a role "tool" message)`
    : "Type a message (Enter sends, Shift+Enter is a new line)";
}

function number(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function samplingFields() {
  const stop = $("stop-strings").value.split("\n").filter((s) => s !== "");
  const fields = {
    temperature: number("temperature"),
    top_p: number("top_p"),
    top_k: number("top_k"),
    max_tokens: number("max_tokens"),
    seed: number("seed"),
    stop: stop.length ? stop : undefined,
  };
  return { ...fields, ...structuredFields() };
}

// What each structured-output choice sends (the server's OpenAI and vLLM fields).
const STRUCTURED = {
  json_object: { hint: "", build: () => ({ response_format: { type: "json_object" } }) },
  json_schema: {
    hint: "JSON schema",
    build: (text) => ({
      response_format: { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(text) } },
    }),
  },
  regex: { hint: "Regular expression", build: (text) => ({ guided_regex: text }) },
  choice: {
    hint: "Choices, one per line",
    build: (text) => ({ guided_choice: text.split("\n").filter((s) => s !== "") }),
  },
};

function structuredFields() {
  const kind = STRUCTURED[$("structured").value];
  const box = $("constraint");
  box.removeAttribute("aria-invalid");
  if (!kind) return {};
  try {
    return kind.build(box.value);
  } catch (e) {
    box.setAttribute("aria-invalid", "true");
    throw new Error(`the JSON schema does not parse: ${e.message}`);
  }
}

// OpenAI's tools, as typed (a JSON list), and tool_choice.
function toolFields() {
  const box = $("tools");
  box.removeAttribute("aria-invalid");
  if (box.value.trim() === "") return {};
  let tools;
  try {
    tools = JSON.parse(box.value);
  } catch (e) {
    box.setAttribute("aria-invalid", "true");
    throw new Error(`the tools do not parse as JSON: ${e.message}`);
  }
  if (!Array.isArray(tools)) {
    box.setAttribute("aria-invalid", "true");
    throw new Error("the tools must be a JSON list of functions");
  }
  return { tools, tool_choice: $("tool-choice").value };
}

function onStructuredChange() {
  const kind = STRUCTURED[$("structured").value];
  $("constraint-label").hidden = !kind || !kind.hint;
  if (kind) $("constraint-hint").textContent = kind.hint;
}

function requestBody(prompt) {
  const body = { model: state.model || undefined, stream: true, stream_options: { include_usage: true } };
  if (mode() === "completion") return { ...body, ...samplingFields(), prompt };
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.messages] : state.messages;
  return { ...body, ...samplingFields(), ...toolFields(), messages };
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (state.controller || prompt.trim() === "") return;
  const chat = mode() === "chat";
  const answering = chat ? pendingCalls()[0] : undefined; // a tool's result, typed in
  const message = answering
    ? { role: "tool", tool_call_id: answering.id, content: prompt }
    : { role: "user", content: prompt };
  let body;
  try {
    if (chat) state.messages.push(message);
    body = requestBody(prompt);
  } catch (e) {
    if (chat) state.messages.pop();
    $("answer-status").textContent = e.message;
    return;
  }
  addEntry(chat ? message.role : "prompt", prompt);
  $("prompt").value = "";
  if (answering && pendingCalls().length) { // more calls to answer before the model goes on
    saveConversation();
    onToolsAnswered();
    return;
  }
  const entry = addEntry(chat ? "assistant" : "completion", "");
  const answer = await stream(chat ? "v1/chat/completions" : "v1/completions", body, entry);
  if (chat && answer !== null) {
    const reply = { role: "assistant", content: answer.calls.length ? answer.text || null : answer.text };
    if (answer.calls.length) reply.tool_calls = answer.calls;
    state.messages.push(reply);
  }
  if (chat && answer === null) state.messages.pop();
  saveConversation();
  onToolsAnswered();
}

// Adds one streamed piece of tool calls (delta.tool_calls, by index) to ``calls``.
function addCallDeltas(calls, deltas) {
  for (const d of deltas || []) {
    const call = (calls[d.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } });
    if (d.id) call.id = d.id;
    if (d.function?.name) call.function.name = d.function.name;
    call.function.arguments += d.function?.arguments ?? "";
  }
}

// Streams one answer into ``entry``; returns its text and tool calls, or null when nothing came
// back.
async function stream(path, body, entry) {
  const out = entry.querySelector(".text");
  const thinking = entry.querySelector(".reasoning");
  const calls = [];
  const timing = { start: performance.now(), first: null, end: null, tokens: 0, chunks: 0 };
  state.controller = new AbortController();
  setBusy(true, entry);
  try {
    const response = await api(path, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) timing.tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices?.[0];
      const delta = choice ? (choice.delta?.content ?? choice.text ?? "") : "";
      const reasoning = choice?.delta?.reasoning_content ?? "";
      const toolDeltas = choice?.delta?.tool_calls;
      if (delta || reasoning || toolDeltas?.length) {
        timing.first ??= performance.now();
        timing.chunks += 1;
        out.textContent += delta;
        thinking.textContent += reasoning;
        thinking.hidden = thinking.textContent === "";
        addCallDeltas(calls, toolDeltas);
        showCalls(entry, calls);
        scrollToEnd();
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      entry.classList.add("error");
      out.textContent += (out.textContent ? "\n" : "") + `error: ${e.message}`;
      setBusy(false, entry);
      $("answer-status").textContent = `Error: ${e.message}`;
      return null;
    }
  }
  timing.end = performance.now();
  entry.querySelector(".stats").textContent = formatTiming(timing);
  setBusy(false, entry);
  $("answer-status").textContent = `Answer complete: ${formatTiming(timing)}`;
  return { text: out.textContent, calls };
}

function formatTiming({ start, first, end, tokens, chunks }) {
  const count = tokens || chunks;
  if (first === null) return `${count} tokens`;
  const ttft = first - start;
  // decode speed: the tokens after the first over the time after the first (llama.cpp's figure)
  const rate = count > 1 && end > first ? ((count - 1) * 1000) / (end - first) : 0;
  return `${count} tokens · TTFT ${ttft.toFixed(0)} ms · ${rate.toFixed(1)} tokens/s`;
}

function setBusy(busy, entry) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("transcript").setAttribute("aria-busy", String(busy));
  if (!busy) state.controller = null;
  else $("answer-status").textContent = "Generating…";
  entry.dataset.done = String(!busy);
}

function onPromptKey(event) {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
}

function onModeChange() {
  for (const id of ["system-label", "tools-label", "tool-choice-label"]) $(id).hidden = mode() !== "chat";
}

// ---- monitor ------------------------------------------------------------------------------------
const monitor = { timer: null, run: 0 };

// The next refresh is timed from the end of the last one, so a slow server gets no pile-up.
function startMonitor() {
  stopMonitor();
  const run = monitor.run;
  const tick = async () => {
    await refreshMonitor();
    if (monitor.run === run) monitor.timer = setTimeout(tick, Number($("refresh").value));
  };
  tick();
}

function stopMonitor() {
  monitor.run += 1;
  clearTimeout(monitor.timer);
}

async function refreshMonitor() {
  try {
    const [device, pages, metrics] = await Promise.all([
      api("device").then((r) => r.json()),
      api("device/pages").then((r) => r.json()),
      fetch("metrics").then((r) => r.text()),
    ]);
    const devices = [device].flat();
    const maps = [pages].flat();
    const figures = parseMetrics(metrics);
    renderCards(devices, maps, figures);
    $("monitor-status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    $("monitor-status").textContent = `cannot read the server: ${e.message}`;
  }
}

// The pagedserve: samples of a Prometheus text exposition, by name (label sets summed).
function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    const match = /^pagedserve:([a-z_]+)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN)$/.exec(line);
    if (match) values[match[1]] = (values[match[1]] || 0) + Number(match[2]);
  }
  return values;
}

function renderCards(devices, maps, figures) {
  const cards = $("cards");
  while (cards.children.length < devices.length) {
    cards.append($("card-template").content.firstElementChild.cloneNode(true));
  }
  devices.forEach((d, i) => renderCard(cards.children[i], d, maps[i], figures, i));
}

function renderCard(card, d, map, figures, index) {
  card.querySelector(".card-title").textContent =
    `Device ${index}: ${d.name} (${d.backend}) · model ${d.model}`;
  card.querySelector(".card-desc").textContent = d.description || "";
  renderTiers(card.querySelector(".tiers"), d.tiers || {});
  if (map) renderPageMap(card, map);
  if (map) renderHostMap(card, map.host);
  const fig = (name, value) => (card.querySelector(`[data-fig=${name}]`).textContent = value);
  fig("running", d.requests?.running ?? 0);
  fig("waiting", d.requests?.waiting ?? 0);
  fig("tps", (d.tokens_per_second || 0).toFixed(1));
  const queries = figures.prefix_cache_queries_total || 0;
  const hits = figures.prefix_cache_hits_total || 0;
  fig("hit", queries ? `${((100 * hits) / queries).toFixed(1)}%` : "–");
  const hostQueries = figures.host_prefix_cache_queries_total || 0;
  const hostHits = figures.host_prefix_cache_hits_total || 0;
  fig("host-hit", hostQueries ? `${((100 * hostHits) / hostQueries).toFixed(1)}%` : "–");
  fig("swapped", figures.num_requests_swapped ?? 0);
  for (const el of card.querySelectorAll(".host-fig")) el.hidden = !d.host_pages;
  // speculative decoding: the drafts' acceptance, from vLLM's counters (see SpecDecodeStats)
  const drafts = figures.spec_decode_num_draft_tokens_total || 0;
  const verifications = figures.spec_decode_num_drafts_total || 0;
  const accepted = figures.spec_decode_num_accepted_tokens_total || 0;
  fig("accept", drafts ? `${((100 * accepted) / drafts).toFixed(1)}%` : "–");
  fig("accept-len", verifications ? (1 + accepted / verifications).toFixed(2) : "–");
  for (const el of card.querySelectorAll(".spec-fig")) el.hidden = !d.speculative;
  // LoRA: which adapter each device slot holds, and the adapters of running and waiting requests
  const lora = d.lora;
  if (lora) {
    fig("lora-slots", lora.slots.map((name) => name || "–").join(", "));
    fig("lora-load", `${lora.running.join(", ") || "–"} / ${lora.waiting.join(", ") || "–"}`);
  }
  for (const el of card.querySelectorAll(".lora-fig")) el.hidden = !lora;
  fig("preempt", figures.num_preemptions_total ?? 0);
  fig("faults", d.faults_detected ?? 0);
  const ttftCount = figures.time_to_first_token_seconds_count || 0;
  const ttftSum = figures.time_to_first_token_seconds_sum || 0;
  fig("ttft", ttftCount ? `${((1000 * ttftSum) / ttftCount).toFixed(0)} ms` : "–");
  fig("gen", (d.generation_tokens_total ?? 0).toLocaleString());
  renderChart(card, d.tokens_per_second_history || []);
}

function mib(bytes) {
  return bytes >= 2 ** 20 ? `${(bytes / 2 ** 20).toFixed(0)} MiB` : `${(bytes / 1024).toFixed(1)} KiB`;
}

function renderTiers(box, tiers) {
  box.replaceChildren();
  for (const [name, tier] of Object.entries(tiers)) {
    const row = document.createElement("div");
    row.className = "tier";
    const used = tier.used_bytes || 0;
    const cap = tier.capacity_bytes;
    row.innerHTML = "<span></span><meter min=0></meter><span></span>";
    const [label, meter, figure] = row.children;
    label.textContent = name;
    meter.setAttribute("aria-label", `${name} tier`);
    meter.max = cap || Math.max(used, 1);
    meter.value = used;
    figure.textContent = cap ? `${mib(used)} / ${mib(cap)}` : `${mib(used)} (unbounded)`;
    box.append(row);
  }
}

// Page frames 0..total-1 as cells left to right, top to bottom; see BlockManager.page_map.
function renderPageMap(card, map) {
  const canvas = card.querySelector(".page-map");
  drawCells(canvas, Array.from(map.cells, Number));
  const counts = map.counts;
  for (const name of STATES) {
    card.querySelector(`[data-count=${name}]`).textContent = counts[name].toLocaleString();
  }
  const inUse = counts.used + counts.shared;
  canvas.dataset.inUse = String(inUse);
  canvas.setAttribute(
    "aria-label",
    `KV page map: ${inUse} of ${map.total} pages in use (${counts.shared} shared), ` +
      `${counts.cached} cached, ${counts.free} free; ${map.block_size} tokens a page` +
      (map.pages_per_cell > 1 ? `; one cell per ${map.pages_per_cell} pages` : ""),
  );
}

// The host tier's frames, a tier of their own: swapped-out pages and spilled prefix blocks.
function renderHostMap(card, host) {
  card.querySelector(".host-tier").hidden = !host;
  if (!host) return;
  const canvas = card.querySelector(".host-map");
  drawCells(canvas, Array.from(host.cells, Number), HOST_STATES);
  for (const name of HOST_STATES) {
    card.querySelector(`[data-host-count=${name}]`).textContent = host.counts[name].toLocaleString();
  }
  canvas.dataset.swapped = String(host.counts.swapped);
  canvas.setAttribute(
    "aria-label",
    `Host tier page map: ${host.counts.swapped} of ${host.total} frames hold swapped-out pages, ` +
      `${host.counts.cached} cached prefix blocks, ${host.counts.free} free` +
      (host.pages_per_cell > 1 ? `; one cell per ${host.pages_per_cell} frames` : ""),
  );
}

function drawCells(canvas, cells, states = STATES) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600;
  const height = canvas.clientHeight || 120;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  // the largest square cell with which every cell fits in the canvas
  let size = Math.floor(Math.sqrt((width * height) / cells.length));
  while (size > 1 && Math.floor(width / size) * Math.floor(height / size) < cells.length) size--;
  const perRow = Math.max(1, Math.floor(width / size));
  const style = getComputedStyle(document.documentElement);
  const colours = states.map((s) => style.getPropertyValue(`--${s}`).trim());
  const gap = size > 4 ? 1 : 0;
  ctx.clearRect(0, 0, width, height);
  cells.forEach((state, i) => {
    ctx.fillStyle = colours[state];
    ctx.fillRect((i % perRow) * size, Math.floor(i / perRow) * size, size - gap, size - gap);
  });
}

// Tokens generated in each second of the last five minutes (the server keeps them), oldest first.
function renderChart(card, perSecond) {
  const peak = Math.max(1, ...perSecond);
  const step = 600 / Math.max(perSecond.length - 1, 1);
  const points = perSecond.map((n, i) => `${(i * step).toFixed(1)},${(118 - (n / peak) * 112).toFixed(1)}`);
  card.querySelector(".chart .line").setAttribute("points", points.join(" "));
  const latest = perSecond.at(-1) ?? 0;
  const summary = `last second ${latest} tokens/s, peak ${peak} in the last 5 minutes`;
  card.querySelector(".chart").setAttribute("aria-label", `Tokens per second chart: ${summary}`);
  card.querySelector(".chart-scale").textContent = summary;
}

// ---- start --------------------------------------------------------------------------------------
function init() {
  $("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadModelName();
  });
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", onTabKey);
  }
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", onPromptKey);
  $("stop").addEventListener("click", () => state.controller?.abort());
  document.addEventListener("keydown", (e) => e.key === "Escape" && state.controller?.abort());
  $("clear").addEventListener("click", clearConversation);
  $("structured").addEventListener("change", onStructuredChange);
  $("model-select").addEventListener("change", () => (state.model = $("model-select").value));
  $("refresh").addEventListener("change", () => !$("monitor").hidden && startMonitor());
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", onModeChange);
  }
  restoreConversation();
  loadModelName();
}

init();
