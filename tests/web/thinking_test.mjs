// A reasoning model on the chat page in headless Chromium, against `fsdp-app serve` of a model
// that thinks before it answers (tests/web.rs starts it): the thinking switch shows for its
// template, the thinking streams into a folded block apart from the answer, and switched off
// the prompt asks for no thinking.
//
//   BASE=http://127.0.0.1:8000 CHROMIUM=/usr/bin/chromium THINKING=... ANSWER=... node tests/web/thinking_test.mjs
import { chromium } from "playwright-core";

const { BASE, CHROMIUM, THINKING, ANSWER } = process.env;
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
  await page.goto(`${BASE}/`);
  await page.waitForFunction(() => document.querySelectorAll("#model option").length > 0);
  check(await page.isVisible("#thinking-label") && await page.isChecked("#thinking"), "the thinking switch shows, on");
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "40");
  const ask = async () => {
    await page.fill("#message", "Hi");
    await page.click("#send");
    await page.waitForFunction(() => [...document.querySelectorAll("#transcript .msg.assistant")].every((m) => m.dataset.done === "true"));
    return page.locator("#transcript .msg.assistant").last();
  };
  const first = await ask();
  const thinking = first.locator("details.thinking");
  check(await thinking.count() === 1, "the thinking has its block");
  check(!(await thinking.evaluate((d) => d.open)), "the thinking is folded");
  check(await thinking.locator("div").textContent() === THINKING, `the thinking: ${JSON.stringify(await thinking.locator("div").textContent())}`);
  check(await first.locator(".answer").textContent() === ANSWER, `the answer apart: ${JSON.stringify(await first.locator(".answer").textContent())}`);
  await page.click("#clear");
  await page.uncheck("#thinking");
  const second = await ask();
  check(await second.locator("details.thinking").count() === 0, "switched off: no thinking block");
  check(errors.length === 0, `no page errors: ${errors.join("; ")}`);
  console.log("browser: thinking checks passed");
} finally {
  await browser.close();
}
