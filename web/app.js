// Shared helpers of the fsdp-app pages: the API key (kept in this browser only), authorised
// fetches with OpenAI-shaped error messages, and reading a chat completion as it streams.
"use strict";

const keyInput = document.getElementById("api-key");
const keyListeners = [];
if (keyInput) {
  keyInput.value = localStorage.getItem("fsdp-api-key") || "";
  keyInput.addEventListener("change", () => {
    localStorage.setItem("fsdp-api-key", keyInput.value);
    for (const f of keyListeners) f();
  });
}

// Runs `f` whenever the API key is changed (so a page can reload what the old key could not read).
function onKeyChange(f) {
  keyListeners.push(f);
}

function authHeaders(extra = {}) {
  const key = keyInput ? keyInput.value : "";
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(path, options = {}) {
  const resp = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
  const text = await resp.text();
  let body;
  try { body = JSON.parse(text); } catch { body = { raw: text }; }
  if (!resp.ok) {
    const msg = body && body.error ? body.error.message : `HTTP ${resp.status}`;
    throw new Error(msg);
  }
  return body;
}

// Fills `select` with the served models: the base, then fine-tuned models and LoRA adapters,
// each shown with the base it runs on. Each option keeps the model's context in data-context.
async function fillModels(select, preferred) {
  const list = await api("/v1/models");
  const base = list.data.find((m) => !m.parent);
  select.innerHTML = "";
  for (const m of list.data) {
    const opt = document.createElement("option");
    opt.value = m.id;
    opt.textContent = m.parent ? `${m.id} (${m.lora ? "LoRA" : "fine-tuned"} on ${m.parent})` : m.id;
    opt.dataset.context = String(m.max_model_len || (base && base.max_model_len) || "");
    // A reasoning model's template switch (adapters run on their base's template).
    const own = m.parent ? list.data.find((b) => b.id === m.parent) || base : m;
    opt.dataset.thinkingSwitch = String(Boolean((own || m).thinking_switch));
    select.appendChild(opt);
  }
  if (preferred) select.value = preferred;
  return list.data;
}

// The request fields of number inputs that are filled in: an emptied field means the server's
// default, so it is left out rather than sent as 0.
function numberFields(fields) {
  const out = {};
  for (const [name, input] of Object.entries(fields)) {
    if (input.value.trim() !== "") out[name] = Number(input.value);
  }
  return out;
}

// Streams a chat completion into `target` (a .msg element): a reasoning model's thinking into a
// folded "Thinking" block as it comes, the answer below it. Marks it data-done="true" at the end
// and counts the content chunks in data-chunks.
async function streamChat(model, messages, params, target) {
  target.dataset.chunks = "0";
  target.dataset.done = "false";
  const resp = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify({ model, messages, stream: true, ...params }),
  });
  if (!resp.ok) {
    const body = await resp.json().catch(() => ({}));
    throw new Error(body.error ? body.error.message : `HTTP ${resp.status}`);
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let text = "";
  let thinking = null;
  const answer = document.createElement("span");
  answer.className = "answer";
  target.textContent = "";
  target.appendChild(answer);
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, nl).trim();
      buffer = buffer.slice(nl + 1);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.reasoning_content) {
        if (!thinking) {
          const details = document.createElement("details");
          details.className = "thinking";
          details.innerHTML = "<summary>Thinking</summary><div></div>";
          target.insertBefore(details, answer);
          thinking = details.querySelector("div");
        }
        thinking.textContent += delta.reasoning_content;
      }
      if (delta && delta.content) {
        text += delta.content;
        answer.textContent = text;
        target.dataset.chunks = String(Number(target.dataset.chunks) + 1);
      }
    }
  }
  target.dataset.done = "true";
  return text;
}

function addMessage(container, role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  container.appendChild(div);
  container.scrollTop = container.scrollHeight;
  return div;
}
