// Settle console: the page's only script. Served by settle serve; nothing loads from elsewhere.
"use strict";

// Forms that name a confirmation ask before they post.
document.addEventListener("submit", (event) => {
  const form = event.target;
  const question = form.getAttribute && form.getAttribute("data-confirm");
  if (question && !window.confirm(question)) event.preventDefault();
});

// A part marked data-refresh="N" is fetched again N seconds after the previous fetch finished
// (never two at once), while the tab is visible, and replaced in place. A failed fetch keeps what
// is shown and waits longer; a session that ended sends the page to sign in.
for (const live of document.querySelectorAll("[data-refresh]")) {
  const every = Math.max(5, Number(live.getAttribute("data-refresh")) || 10) * 1000;
  let wait = every;
  const refresh = async () => {
    if (!document.hidden) {
      try {
        const response = await fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } });
        if (response.redirected && new URL(response.url).pathname === "/console/login") {
          window.location.assign("/console/login");
          return;
        }
        if (!response.ok) throw new Error(String(response.status));
        const next = new DOMParser().parseFromString(await response.text(), "text/html").getElementById(live.id);
        const current = document.getElementById(live.id);
        if (next && current) current.replaceWith(next);
        wait = every;
      } catch (_) {
        wait = Math.min(wait * 2, 5 * 60 * 1000);
      }
    }
    setTimeout(refresh, wait);
  };
  setTimeout(refresh, wait);
}
