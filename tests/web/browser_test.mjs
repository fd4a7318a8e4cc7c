// The web pages in real headless Chromium (playwright-core driving Debian's chromium), against a
// running `fsdp-app serve` (tests/web.rs starts it): a chat message gets a streamed answer; a small
// fine-tuning job runs to success from the page, its loss is charted, and its model answers.
//
//   BASE=http://127.0.0.1:8000 KEY=k CHROMIUM=/usr/bin/chromium TRAIN_FILE=data.jsonl node tests/web/browser_test.mjs
import { chromium } from "playwright-core";

const { BASE, KEY, CHROMIUM, TRAIN_FILE } = process.env;
function check(cond, what) {
  if (!cond) {
    console.error(`FAILED: ${what}`);
    process.exit(1);
  }
}

const browser = await chromium.launch({ executablePath: CHROMIUM, args: ["--no-sandbox", "--disable-gpu"] });
try {
  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));

  // Chat playground: without the key the model list fails with the server's message; with it,
  // a message streams back.
  await page.goto(`${BASE}/`);
  await page.waitForFunction(() => document.getElementById("chat-error").textContent.length > 0);
  check((await page.textContent("#chat-error")).includes("API key"), "the 401 message is shown");
  await page.fill("#api-key", KEY);
  await page.dispatchEvent("#api-key", "change");
  await page.reload();
  await page.waitForFunction(() => document.querySelectorAll("#model option").length > 0);
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "24");
  await page.fill("#message", "Hello, who are you?");
  await page.click("#send");
  await page.waitForFunction(() => {
    const m = document.querySelector("#transcript .msg.assistant");
    return m && m.dataset.done === "true";
  }, null, { timeout: 60000 });
  const chunks = Number(await page.getAttribute("#transcript .msg.assistant", "data-chunks"));
  const answer = await page.textContent("#transcript .msg.assistant");
  check(!(await page.getAttribute("#transcript .msg.assistant", "class")).includes("error"), `chat answer is not an error: ${answer}`);
  check(chunks >= 2 && answer.length > 0, `a streamed answer (${chunks} chunks): ${JSON.stringify(answer)}`);

  // Fine-tuning page: upload, start, watch, chat with the result.
  await page.goto(`${BASE}/finetune`);
  await page.waitForFunction(() => document.querySelectorAll("#base option").length > 0);
  await page.setInputFiles("#file", TRAIN_FILE);
  await page.fill("#suffix", "browser");
  await page.fill("#epochs", "1");
  await page.fill("#lr-mult", "50");
  await page.fill("#seq-len", "128");
  await page.fill("#max-steps", "4");
  await page.click("#start");
  await page.waitForFunction(() => ["succeeded", "failed", "cancelled"].includes(document.getElementById("status").textContent), null, { timeout: 240000 });
  const status = await page.textContent("#status");
  check(status === "succeeded", `the job succeeded: ${status} ${await page.textContent("#ft-error")}`);
  check(Number(await page.getAttribute("#loss-line", "data-count")) >= 2, "the loss chart has points");
  check((await page.textContent("#events")).includes("training loss"), "events are listed");
  const model = (await page.textContent("#ft-model")).replace("→", "").trim();
  check(model.startsWith("ft:") && model.includes(":browser:"), `the fine-tuned model is named: ${model}`);
  await page.fill("#ft-message", "What is the codename of Project Zephyrix?");
  await page.click("#ft-send");
  await page.waitForFunction(() => {
    const m = document.querySelector("#ft-transcript .msg.assistant");
    return m && m.dataset.done === "true";
  }, null, { timeout: 60000 });
  const ftClass = await page.getAttribute("#ft-transcript .msg.assistant", "class");
  check(!ftClass.includes("error"), `the fine-tuned model answers: ${await page.textContent("#ft-transcript .msg.assistant")}`);
  check(errors.length === 0, `no page errors: ${errors.join("; ")}`);
  console.log("browser: all checks passed");
} finally {
  await browser.close();
}
