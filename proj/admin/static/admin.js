// proj admin: the page's only script, served from /admin/static (CSP: script-src 'self').
//  - forms with data-confirm ask before they submit;
//  - a run page (#progress[data-live-run]) polls its progress JSON, reloading when the run
//    changes state or step, otherwise updating the bars in place;
//  - a request page ([data-live-request]) reloads while the request is still moving.
"use strict";

document.addEventListener("submit", function (ev) {
  const form = ev.target;
  const question = form && form.dataset ? form.dataset.confirm : null;
  if (question && !window.confirm(question)) { ev.preventDefault(); }
}, true);

function progressRow(p) {
  const pct = p.pct === null ? 0 : p.pct;
  const d = document.createElement("div"); d.className = "progress-row";
  const name = document.createElement("span"); name.className = "mono";
  name.textContent = p.step + (p.item ? "[" + p.item + "]" : "");
  const bar = document.createElement("div"); bar.className = "bar";
  const fill = document.createElement("div"); fill.style.width = pct + "%"; bar.appendChild(fill);
  const label = document.createElement("span"); label.className = "pct";
  label.textContent = (p.pct === null ? "?" : p.pct.toFixed(1)) + "%";
  const msg = document.createElement("span"); msg.className = "muted"; msg.textContent = p.message || "";
  d.append(name, bar, label, msg); return d;
}

function followRun(box) {
  const runId = box.dataset.liveRun, initial = box.dataset.status, initialStep = box.dataset.step || null;
  async function tick() {
    try {
      const r = await fetch("/admin/runs/" + runId + "/progress.json", {credentials: "same-origin", cache: "no-store"});
      if (r.ok) {
        const data = await r.json();
        if (data.status !== initial || (data.current_step || null) !== initialStep) { location.reload(); return; }
        const step = document.getElementById("current-step");
        if (step) { step.textContent = data.current_step || "—"; }
        if (data.progress.length) { box.replaceChildren(...data.progress.map(progressRow)); }
      }
    } catch (e) { /* server restarting: keep polling */ }
    setTimeout(tick, 1000);
  }
  setTimeout(tick, 1000);
}

function followRequest(el) {
  const every = parseInt(el.dataset.refreshMs || "2000", 10);
  setTimeout(function () { location.reload(); }, every);
}

document.addEventListener("DOMContentLoaded", function () {
  const box = document.querySelector("#progress[data-live-run]");
  if (box) { followRun(box); }
  const req = document.querySelector("[data-live-request]");
  if (req) { followRequest(req); }
});
