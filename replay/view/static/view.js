// replay view: the page's only script. It never evaluates text from the log:
// token texts go in with textContent, pages are re-fetched from our own server.
"use strict";

function shadeLogprobs(root) {
  for (const el of root.querySelectorAll(".tok.out[data-lp]")) {
    const lp = parseFloat(el.dataset.lp);
    if (Number.isNaN(lp)) continue;
    const p = Math.exp(lp); // 1 = certain: no shade; 0 = unlikely: dark
    el.style.backgroundColor = `rgba(200, 60, 60, ${(1 - p).toFixed(3)})`;
  }
}

// Poll the log position; when it moved, re-fetch this page and swap <main>.
function follow() {
  const body = document.body;
  if (!body.dataset.poll) return;
  let position = body.dataset.position;
  const session = body.dataset.session;
  const url = "/api/position" + (session ? "?session=" + encodeURIComponent(session) : "");
  const live = document.getElementById("live");
  async function tick() {
    try {
      const r = await fetch(url, { credentials: "same-origin" });
      if (r.ok) {
        const j = await r.json();
        const now = String(session ? j.session_position : j.position);
        if (now !== position) {
          const page = await fetch(location.href, { credentials: "same-origin" });
          if (page.ok) {
            const doc = new DOMParser().parseFromString(await page.text(), "text/html");
            const fresh = doc.querySelector("main");
            if (fresh) {
              document.querySelector("main").replaceChildren(...fresh.childNodes);
              shadeLogprobs(document);
            }
            position = now;
            live.hidden = false;
            live.textContent = "live · updated " + new Date().toLocaleTimeString();
          }
        }
      }
    } catch (e) {
      live.hidden = false;
      live.textContent = "live · log unreachable";
    }
    setTimeout(tick, 1500);
  }
  setTimeout(tick, 1500);
}

// Sample tokens arrive in chunks as the reader scrolls (a 200k-token sample
// would take seconds to lay out at once).
function sampleTokens() {
  const body = document.body;
  const base = body.dataset.sampleUrl;
  if (!base) return;
  const total = parseInt(body.dataset.total, 10);
  const box = document.getElementById("sample-tokens");
  const more = document.getElementById("more");
  const shown = document.getElementById("shown");
  let next = 0;
  let busy = false;
  async function load() {
    if (busy || next >= total) return;
    busy = true;
    const r = await fetch(`${base}?start=${next}`, { credentials: "same-origin" });
    const j = await r.json();
    const frag = document.createDocumentFragment();
    for (const [id, text, mask, lp, version, turn, origin, reason] of j.rows) {
      const s = document.createElement("span");
      s.className = "tok m" + mask;
      s.textContent = text;
      const i = j.start + frag.childNodes.length;
      let tip = `#${i} id ${id} · turn ${turn} ${origin}`;
      if (mask >= 0) tip += ` · loss mask ${mask} · logprob ${lp.toFixed(4)}`;
      if (version) tip += ` · weights ${version}`;
      if (reason && mask === 0) tip += ` · ${reason}`;
      s.title = tip;
      frag.appendChild(s);
    }
    box.appendChild(frag);
    next = j.start + j.rows.length;
    shown.textContent = `${next} of ${total} shown`;
    if (next >= total) {
      more.textContent = "end of sample";
      more.dataset.done = "1";
    }
    busy = false;
    if (next < total && more.getBoundingClientRect().top < window.innerHeight * 2) load();
  }
  new IntersectionObserver((entries) => {
    if (entries.some((e) => e.isIntersecting)) load();
  }, { rootMargin: "800px" }).observe(more);
  load();
}

document.addEventListener("DOMContentLoaded", () => {
  shadeLogprobs(document);
  follow();
  sampleTokens();
});
