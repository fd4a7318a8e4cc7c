// The web pages in real headless Chromium (playwright-core driving Debian's chromium), against a
// running `fsdp-app serve` (tests/web.rs starts it): a chat message gets a streamed answer; a small
// fine-tuning job runs to success from the page, its loss is charted, and its model answers.
//
//   BASE=http://127.0.0.1:8000 KEY=k CHROMIUM=/usr/bin/chromium TRAIN_FILE=data.jsonl PREFERENCE_FILE=pairs.jsonl PROMPT_FILE=prompts.jsonl node tests/web/browser_test.mjs
import { chromium } from "playwright-core";

const { BASE, KEY, CHROMIUM, TRAIN_FILE, PREFERENCE_FILE, PROMPT_FILE } = process.env;
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

  // Chat playground: without the key the model list fails with the server's message, and Send
  // says there is no model (not "The model `` does not exist"); the key typed then loads the
  // list without a reload, adapters shown with their base; a message streams back with max
  // tokens emptied (the server's default, not 0).
  await page.goto(`${BASE}/`);
  check(await page.$("meta[name=viewport]"), "a viewport for narrow screens");
  check(await page.$("label[for=api-key]"), "the key field is labelled");
  await page.waitForFunction(() => document.getElementById("chat-error").textContent.length > 0);
  check((await page.textContent("#chat-error")).includes("API key"), "the 401 message is shown");
  await page.fill("#message", "Hello?");
  await page.click("#send");
  check((await page.textContent("#chat-error")).includes("No model"), `Send without a model: ${await page.textContent("#chat-error")}`);
  await page.fill("#api-key", KEY);
  await page.dispatchEvent("#api-key", "change");
  await page.waitForFunction(() => document.querySelectorAll("#model option").length > 0);
  const options = await page.$$eval("#model option", (os) => os.map((o) => [o.value, o.textContent]));
  check(options[0][0] === "tiny" && options.some(([v, t]) => v === "web-lora" && t.includes("LoRA on tiny")), `the picker: ${JSON.stringify(options)}`);
  check((await page.textContent("#chat-error")) === "", "the 401 message is gone");
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "");
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

  // A narrow screen stacks the settings above the conversation.
  await page.setViewportSize({ width: 400, height: 800 });
  const [aside, section] = [await page.$eval("aside", (e) => e.getBoundingClientRect().bottom), await page.$eval("main section", (e) => e.getBoundingClientRect().top)];
  check(section >= aside, `narrow: the conversation below the settings (${section} vs ${aside})`);
  await page.setViewportSize({ width: 1280, height: 800 });

  // Fine-tuning page: its defaults fit the model (the sequence length within its context); upload
  // training and validation data, start, watch the loss chart (axes with steps and losses, the
  // validation curve) and the events (one per line), chat with the result.
  await page.goto(`${BASE}/finetune`);
  await page.waitForFunction(() => document.querySelectorAll("#base option").length > 0);
  const context = await page.evaluate(async (key) => {
    const r = await fetch("/v1/models", { headers: { Authorization: `Bearer ${key}` } });
    return (await r.json()).data[0].max_model_len;
  }, KEY);
  const seqLen = Number(await page.inputValue("#seq-len"));
  check(seqLen === Math.min(512, context) && Number(await page.getAttribute("#seq-len", "max")) === context, `seq-len ${seqLen} fits the context ${context}`);
  await page.setInputFiles("#file", TRAIN_FILE);
  await page.setInputFiles("#validation", TRAIN_FILE);
  await page.fill("#suffix", "browser");
  await page.fill("#epochs", "1");
  await page.fill("#lr-mult", "50");
  await page.fill("#max-steps", "4");
  await page.click("#start");
  await page.waitForFunction(() => ["succeeded", "failed", "cancelled"].includes(document.getElementById("status").textContent), null, { timeout: 240000 });
  const status = await page.textContent("#status");
  check(status === "succeeded", `the job succeeded: ${status} ${await page.textContent("#ft-error")}`);
  check(Number(await page.getAttribute("#loss-line", "data-count")) >= 2, "the loss chart has points");
  check(Number(await page.getAttribute("#eval-line", "data-count")) >= 1, "the chart has the validation curve");
  const ticks = await page.$$eval("#axes text", (ts) => ts.map((t) => t.textContent));
  check(ticks.includes("step") && ticks.some((t) => /^\d+\.\d{3}$/.test(t)) && ticks.includes("4"), `axes with steps and losses: ${ticks}`);
  const lines = await page.$$eval("#events div", (ds) => ds.map((d) => d.textContent));
  check(lines.length >= 4 && lines.some((l) => l.startsWith("Step 4: training loss")), `events one per line: ${JSON.stringify(lines)}`);
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

  // DPO from the same form: the method picker shows beta, a preference file trains a model.
  await page.goto(`${BASE}/finetune`);
  await page.waitForFunction(() => document.querySelectorAll("#base option").length > 0);
  check(await page.isHidden("#beta") && await page.isHidden("#beta-label"), "beta and its label are hidden for supervised fine-tuning");
  await page.selectOption("#method", "dpo");
  check(await page.isVisible("#beta") && await page.isVisible("#beta-label"), "beta and its label show for DPO");
  await page.fill("#beta", "0.2");
  await page.setInputFiles("#file", PREFERENCE_FILE);
  await page.fill("#suffix", "browser-dpo");
  await page.fill("#epochs", "1");
  await page.fill("#lr-mult", "50");
  await page.fill("#max-steps", "2");
  await page.click("#start");
  await page.waitForFunction(() => ["succeeded", "failed", "cancelled"].includes(document.getElementById("status").textContent), null, { timeout: 240000 });
  const dpoStatus = await page.textContent("#status");
  check(dpoStatus === "succeeded", `the DPO job succeeded: ${dpoStatus} ${await page.textContent("#ft-error")}`);
  const dpoJob = await page.evaluate(async ([key, id]) => {
    const r = await fetch(`/v1/fine_tuning/jobs/${id}`, { headers: { Authorization: `Bearer ${key}` } });
    return r.json();
  }, [KEY, await page.textContent("#job-id")]);
  check(dpoJob.method.type === "dpo" && dpoJob.method.dpo.hyperparameters.beta === 0.2, `the job is DPO with beta 0.2: ${JSON.stringify(dpoJob.method)}`);
  check((await page.textContent("#ft-model")).includes(":browser-dpo:"), "the DPO model is named");

  // Reinforcement (GRPO) from the same form: the grader editor shows, a prompt file trains.
  await page.goto(`${BASE}/finetune`);
  await page.waitForFunction(() => document.querySelectorAll("#base option").length > 0);
  check(await page.isHidden("#grader"), "the grader editor is hidden for supervised fine-tuning");
  await page.selectOption("#method", "reinforcement");
  check(await page.isVisible("#grader") && await page.isHidden("#beta") && await page.isHidden("#validation"), "the grader editor shows for GRPO, beta and validation do not");
  await page.selectOption("#grader-operation", "ilike");
  await page.fill("#grader-name", "has_sum");
  await page.fill("#generations", "4");
  await page.setInputFiles("#file", PROMPT_FILE);
  await page.fill("#suffix", "browser-grpo");
  await page.fill("#epochs", "1");
  await page.fill("#max-steps", "2");
  await page.click("#start");
  await page.waitForFunction(() => ["succeeded", "failed", "cancelled"].includes(document.getElementById("status").textContent), null, { timeout: 240000 });
  const grpoStatus = await page.textContent("#status");
  check(grpoStatus === "succeeded", `the GRPO job succeeded: ${grpoStatus} ${await page.textContent("#ft-error")}`);
  const grpoJob = await page.evaluate(async ([key, id]) => {
    const r = await fetch(`/v1/fine_tuning/jobs/${id}`, { headers: { Authorization: `Bearer ${key}` } });
    return r.json();
  }, [KEY, await page.textContent("#job-id")]);
  const grader = grpoJob.method.reinforcement && grpoJob.method.reinforcement.grader;
  check(grpoJob.method.type === "reinforcement" && grader.type === "string_check" && grader.operation === "ilike" && grader.name === "has_sum"
    && grader.reference === "{{item.answer}}" && grpoJob.method.reinforcement.hyperparameters.compute_multiplier === 0.5,
    `the job is GRPO with the editor's grader: ${JSON.stringify(grpoJob.method)}`);
  check((await page.textContent("#events")).includes("mean reward="), `the events show the mean reward: ${await page.textContent("#events")}`);
  check(errors.length === 0, `no page errors: ${errors.join("; ")}`);
  console.log("browser: all checks passed");
} finally {
  await browser.close();
}
