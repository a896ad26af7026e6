// textgate playground: streams /v1/chat/completions over SSE with fetch + ReadableStream.
//
// Model text is never parsed as HTML: markdown is turned into DOM nodes whose text is set
// with textContent / append(string), so a "<script>" in an answer stays text. The page is
// served with a CSP that allows only its own script and style files besides.
"use strict";

(() => {
  const SETTINGS_KEY = "textgate.playground.settings";
  const API_KEY_KEY = "textgate.playground.apiKey";
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"),
    settings: $("settings"),
    settingsForm: $("settings-form"),
    system: $("system"),
    temperature: $("temperature"),
    topP: $("top-p"),
    maxTokens: $("max-tokens"),
    apiKey: $("api-key"),
    newChat: $("new-chat"),
    log: $("log"),
    empty: $("empty"),
    error: $("error"),
    composer: $("composer"),
    prompt: $("prompt"),
    send: $("send"),
    stop: $("stop"),
  };
  // The conversation so far (OpenAI messages, without the system prompt).
  const history = [];
  // Bumped by "New chat", so an answer that ends after it stays out of the new conversation.
  let conversation = 0;
  let controller = null;

  // ---- settings, remembered in this browser ----

  function loadSettings() {
    let saved = {};
    try {
      saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {};
    } catch {
      saved = {};
    }
    for (const [name, input] of [["system", ui.system], ["temperature", ui.temperature],
      ["topP", ui.topP], ["maxTokens", ui.maxTokens]]) {
      if (typeof saved[name] === "string") input.value = saved[name];
    }
    ui.apiKey.value = localStorage.getItem(API_KEY_KEY) || "";
  }

  function saveSettings() {
    const values = {
      system: ui.system.value,
      temperature: ui.temperature.value,
      topP: ui.topP.value,
      maxTokens: ui.maxTokens.value,
    };
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(values));
    if (ui.apiKey.value) localStorage.setItem(API_KEY_KEY, ui.apiKey.value);
    else localStorage.removeItem(API_KEY_KEY);
  }

  function headers() {
    const result = { "content-type": "application/json" };
    if (ui.apiKey.value) result.authorization = `Bearer ${ui.apiKey.value}`;
    return result;
  }

  // ---- errors: always shown, never swallowed ----

  function showError(message) {
    ui.error.textContent = message;
    ui.error.hidden = false;
  }

  function clearError() {
    ui.error.textContent = "";
    ui.error.hidden = true;
  }

  async function httpError(response) {
    let detail = "";
    try {
      const text = await response.text();
      try {
        const body = JSON.parse(text);
        detail = (body.error && (body.error.message || body.error)) || text;
      } catch {
        detail = text;
      }
    } catch {
      detail = "";
    }
    let message = `HTTP ${response.status} ${response.statusText}`.trim();
    if (detail) message += `: ${detail}`;
    if (response.status === 401) message += " (set the API key in Settings)";
    return message;
  }

  // ---- markdown, as DOM nodes ----

  const INLINE = new RegExp([
    "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)", // 1, 2: code span
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 3: strong
    "(?<!\\w)__(?=\\S)([\\s\\S]*?\\S)__(?!\\w)", // 4: strong
    "\\*(?=[^\\s*])([^*]*?[^\\s*])\\*", // 5: emphasis
    "(?<!\\w)_(?=[^\\s_])([^_]*?[^\\s_])_(?!\\w)", // 6: emphasis
    "\\[([^\\]\\n]+)\\]\\(([^)\\s]+)\\)", // 7, 8: link
  ].join("|"), "g");

  function element(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  function safeHref(href) {
    try {
      const url = new URL(href, location.href);
      return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
    } catch {
      return null;
    }
  }

  function appendInline(parent, text) {
    let last = 0;
    for (const match of text.matchAll(INLINE)) {
      parent.append(text.slice(last, match.index));
      last = match.index + match[0].length;
      if (match[2] !== undefined) {
        const code = element("code");
        code.textContent = match[2];
        parent.append(code);
      } else if (match[3] !== undefined || match[4] !== undefined) {
        const strong = element("strong");
        appendInline(strong, match[3] ?? match[4]);
        parent.append(strong);
      } else if (match[5] !== undefined || match[6] !== undefined) {
        const em = element("em");
        appendInline(em, match[5] ?? match[6]);
        parent.append(em);
      } else {
        const href = safeHref(match[8]);
        if (href === null) {
          parent.append(match[0]);
          continue;
        }
        const link = element("a");
        link.href = href;
        link.rel = "noopener noreferrer";
        link.target = "_blank";
        appendInline(link, match[7]);
        parent.append(link);
      }
    }
    parent.append(text.slice(last));
  }

  function appendLines(parent, lines) {
    lines.forEach((line, index) => {
      if (index > 0) parent.append(element("br"));
      appendInline(parent, line);
    });
  }

  function codeBlock(code, language) {
    const pre = element("pre");
    const body = element("code");
    if (language) {
      body.className = `language-${language}`;
      const label = element("span", "lang");
      label.textContent = language;
      label.setAttribute("aria-hidden", "true");
      pre.append(label);
    }
    body.textContent = code;
    pre.append(body);
    return pre;
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const LIST_ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const QUOTE = /^ {0,3}>\s?(.*)$/;

  // Markdown to a fragment: fenced code (an unclosed fence while streaming is code so far),
  // headings, lists, quotes and paragraphs; inline code, emphasis and http(s) links.
  function renderMarkdown(text) {
    const fragment = document.createDocumentFragment();
    const lines = text.split("\n");
    let i = 0;
    const startsBlock = (line) =>
      !line.trim() || FENCE.test(line) || HEADING.test(line) || LIST_ITEM.test(line) ||
      QUOTE.test(line);
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(FENCE);
      if (fence) {
        const closing = new RegExp(`^ {0,3}${fence[1][0]}{${fence[1].length},}\\s*$`);
        const code = [];
        for (i += 1; i < lines.length && !closing.test(lines[i]); i += 1) code.push(lines[i]);
        i += 1;
        fragment.append(codeBlock(code.join("\n"), fence[2]));
        continue;
      }
      if (!line.trim()) {
        i += 1;
        continue;
      }
      const heading = line.match(HEADING);
      if (heading) {
        const node = element(`h${Math.min(heading[1].length + 1, 6)}`);
        appendInline(node, heading[2]);
        fragment.append(node);
        i += 1;
        continue;
      }
      const item = line.match(LIST_ITEM);
      if (item) {
        const ordered = /\d/.test(item[1]);
        const list = element(ordered ? "ol" : "ul");
        if (ordered && parseInt(item[1], 10) !== 1) list.start = parseInt(item[1], 10);
        for (; i < lines.length; i += 1) {
          const next = lines[i].match(LIST_ITEM);
          if (!next || /\d/.test(next[1]) !== ordered) break;
          const li = element("li");
          appendInline(li, next[2]);
          list.append(li);
        }
        fragment.append(list);
        continue;
      }
      if (QUOTE.test(line)) {
        const quote = element("blockquote");
        const quoted = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i += 1) quoted.push(lines[i].match(QUOTE)[1]);
        appendLines(quote, quoted);
        fragment.append(quote);
        continue;
      }
      const paragraph = [line];
      for (i += 1; i < lines.length && !startsBlock(lines[i]); i += 1) paragraph.push(lines[i]);
      const node = element("p");
      appendLines(node, paragraph);
      fragment.append(node);
    }
    return fragment;
  }

  // ---- the conversation view ----

  function nearBottom() {
    return window.innerHeight + window.scrollY >= document.body.scrollHeight - 80;
  }

  function addMessage(role) {
    ui.empty.hidden = true;
    const root = element("article", `message ${role}`);
    const label = element("p", "role");
    label.textContent = role === "user" ? "You" : "Assistant";
    const body = element("div", "body");
    root.append(label, body);
    ui.log.append(root);
    window.scrollTo(0, document.body.scrollHeight);
    return { root, body };
  }

  function addAnswer() {
    const view = addMessage("assistant");
    view.stats = element("p", "stats");
    view.stats.setAttribute("aria-label", "Answer statistics");
    view.root.append(view.stats);
    view.root.classList.add("streaming");
    view.painted = null;
    view.scheduled = false;
    return view;
  }

  function formatStats(meter, finished) {
    const parts = [];
    if (meter.first !== null) parts.push(`TTFT ${Math.round(meter.first - meter.start)} ms`);
    const tokens = finished && meter.usage !== null ? meter.usage : meter.tokens;
    parts.push(`${tokens} ${tokens === 1 ? "token" : "tokens"}`);
    if (meter.tokens > 1 && meter.last > meter.first) {
      const rate = (meter.tokens - 1) / ((meter.last - meter.first) / 1000);
      parts.push(`${rate.toFixed(1)} tokens/s`);
    }
    return parts.join(" · ");
  }

  function paint(view, text, meter, finished) {
    if (view.painted !== text) {
      const follow = nearBottom();
      view.body.replaceChildren(renderMarkdown(text));
      view.painted = text;
      if (follow) window.scrollTo(0, document.body.scrollHeight);
    }
    view.stats.textContent = formatStats(meter, finished);
  }

  // One repaint per frame however fast tokens come.
  function schedulePaint(view, answer, meter) {
    if (view.scheduled) return;
    view.scheduled = true;
    requestAnimationFrame(() => {
      view.scheduled = false;
      paint(view, answer.text, meter, false);
    });
  }

  function addNote(view, text, failed) {
    const note = element("p", failed ? "note failed" : "note");
    note.textContent = text;
    view.root.append(note);
  }

  // ---- SSE over fetch ----

  // The `data:` payload of each event of a text/event-stream body, as it arrives.
  async function* sseData(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    const boundary = /\r?\n\r?\n/;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      for (let match = buffer.match(boundary); match; match = buffer.match(boundary)) {
        const block = buffer.slice(0, match.index);
        buffer = buffer.slice(match.index + match[0].length);
        const data = block.split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  }

  // An error event: OpenAI's {"error": {"message", "type"}} with TGI's error_type beside it.
  function streamError(chunk) {
    const error = typeof chunk.error === "object" ? chunk.error : { message: chunk.error };
    const type = chunk.error_type || error.type;
    const message = error.message || JSON.stringify(chunk.error);
    return `The server ended the answer with an error${type ? ` (${type})` : ""}: ${message}`;
  }

  // ---- sending ----

  function setBusy(busy) {
    ui.send.disabled = busy;
    ui.stop.disabled = !busy;
    ui.log.setAttribute("aria-busy", String(busy));
  }

  function requestBody(messages) {
    return JSON.stringify({
      messages,
      stream: true,
      stream_options: { include_usage: true },
      // Per-token logprobs count tokens exactly as they arrive (a chunk may carry several).
      logprobs: true,
      temperature: Number(ui.temperature.value),
      top_p: Number(ui.topP.value),
      max_tokens: Number(ui.maxTokens.value),
    });
  }

  async function send() {
    const text = ui.prompt.value;
    if (controller !== null || !text.trim()) return;
    if (!ui.settingsForm.checkValidity()) {
      ui.settings.open = true;
      ui.settingsForm.reportValidity();
      return;
    }
    clearError();
    saveSettings();
    ui.prompt.value = "";
    const user = { role: "user", content: text };
    addMessage("user").body.textContent = text;
    const system = ui.system.value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...history, user];
    const view = addAnswer();
    const answer = { text: "" };
    const meter = { start: performance.now(), first: null, last: null, tokens: 0, usage: null };
    let failure = null;
    let stopped = false;
    let ended = false;
    let finish = null;
    const started = conversation;
    controller = new AbortController();
    setBusy(true);
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: headers(),
        body: requestBody(messages),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await httpError(response));
      for await (const data of sseData(response)) {
        if (data === "[DONE]") {
          ended = true;
          break;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) {
          failure = streamError(chunk);
          break;
        }
        if (chunk.usage) meter.usage = chunk.usage.completion_tokens;
        for (const choice of chunk.choices || []) {
          const delta = (choice.delta && choice.delta.content) || "";
          const count = choice.logprobs && choice.logprobs.content
            ? choice.logprobs.content.length
            : (delta ? 1 : 0);
          if (count > 0) {
            const now = performance.now();
            if (meter.first === null) meter.first = now;
            meter.last = now;
            meter.tokens += count;
          }
          answer.text += delta;
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        schedulePaint(view, answer, meter);
      }
      if (!ended && failure === null) failure = "The connection closed before the answer ended.";
    } catch (error) {
      if (error.name === "AbortError") stopped = true;
      else failure = error.message || String(error);
    } finally {
      controller = null;
      setBusy(false);
    }
    view.root.classList.remove("streaming");
    paint(view, answer.text, meter, !stopped && failure === null);
    if (stopped) addNote(view, "Stopped.", false);
    if (finish === "length") addNote(view, "Reached the max tokens.", false);
    if (failure !== null) {
      addNote(view, failure, true);
      showError(failure);
    }
    // The conversation keeps what was said, a stopped answer's part included.
    if (answer.text && started === conversation) {
      history.push(user, { role: "assistant", content: answer.text });
    }
    ui.prompt.focus();
  }

  function stop() {
    if (controller !== null) controller.abort();
  }

  function newChat() {
    stop();
    conversation += 1;
    history.length = 0;
    for (const message of ui.log.querySelectorAll(".message")) message.remove();
    ui.empty.hidden = false;
    clearError();
    ui.prompt.focus();
  }

  async function showModel() {
    try {
      const response = await fetch("info", { headers: headers() });
      if (!response.ok) throw new Error(await httpError(response));
      const info = await response.json();
      ui.model.textContent = `${info.model_id} · textgate ${info.version}`;
    } catch (error) {
      ui.model.textContent = "server unreachable";
      showError(`Could not read /info: ${error.message || error}`);
    }
  }

  // ---- wiring ----

  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.altKey && !event.ctrlKey &&
      !event.metaKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && controller !== null) stop();
  });
  ui.stop.addEventListener("click", stop);
  ui.newChat.addEventListener("click", newChat);
  ui.settingsForm.addEventListener("change", saveSettings);
  ui.apiKey.addEventListener("input", saveSettings);
  ui.settingsForm.addEventListener("submit", (event) => event.preventDefault());

  loadSettings();
  if (window.matchMedia("(min-width: 40rem)").matches) ui.settings.open = true;
  showModel();
  ui.prompt.focus();
})();
