// Shared helpers of the fsdp-app pages: the API key (kept in this browser only), authorised
// fetches with OpenAI-shaped error messages, and reading a chat completion as it streams.
"use strict";

const keyInput = document.getElementById("api-key");
if (keyInput) {
  keyInput.value = localStorage.getItem("fsdp-api-key") || "";
  keyInput.addEventListener("change", () => localStorage.setItem("fsdp-api-key", keyInput.value));
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

async function fillModels(select, preferred) {
  const list = await api("/v1/models");
  select.innerHTML = "";
  for (const m of list.data) {
    const opt = document.createElement("option");
    opt.value = opt.textContent = m.id;
    select.appendChild(opt);
  }
  if (preferred) select.value = preferred;
}

// Streams a chat completion into `target` (a .msg element). Marks it data-done="true" at the end
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
      if (delta && delta.content) {
        text += delta.content;
        target.textContent = text;
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
