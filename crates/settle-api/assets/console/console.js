// Settle console: the page's only script. Served by settle serve; nothing loads from elsewhere.
"use strict";

// Forms that name a confirmation ask before they post.
document.addEventListener("submit", (event) => {
  const form = event.target;
  const question = form.getAttribute && form.getAttribute("data-confirm");
  if (question && !window.confirm(question)) event.preventDefault();
});

// A part marked data-refresh="N" is fetched again every N seconds while the tab is visible and
// replaced in place; a failed fetch keeps what is shown.
for (const live of document.querySelectorAll("[data-refresh]")) {
  const seconds = Math.max(2, Number(live.getAttribute("data-refresh")) || 5);
  setInterval(async () => {
    if (document.hidden) return;
    try {
      const response = await fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } });
      if (!response.ok) return;
      const next = new DOMParser().parseFromString(await response.text(), "text/html").getElementById(live.id);
      const current = document.getElementById(live.id);
      if (next && current) current.replaceWith(next);
    } catch (_) { /* offline for a moment: keep the page */ }
  }, seconds * 1000);
}
