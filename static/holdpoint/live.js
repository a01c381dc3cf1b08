/* Live pages (API.md, "Live events"): an element with data-live-stream="<stream url>" and
   "live" among its hx-triggers is re-fetched by htmx as soon as its stream sends an event,
   instead of on its polling interval. While the stream is open the element's polls are held
   back to one per HOLD_MS (for what no stream carries, e.g. the reconciliation queue); while
   it is down (a server without streams, a proxy that cuts them, the account's streams all
   open in other tabs: 429) polling goes on as before, and without JavaScript nothing here
   runs at all.

   The stream is read with fetch, not EventSource: EventSource delivers a named event
   ("event: lease_taken") only to a listener for that very name, and a page needs to know of
   any entry. It reconnects after RETRY_MS with Last-Event-ID, and stops once no element on
   the page names its URL (a finished run's fragment comes without data-live-stream). */
(function () {
  "use strict";
  const RETRY_MS = 3000;
  const HOLD_MS = 30000;
  const streams = new Map(); // url -> {open, last, refreshed, wait}

  function targets(url) {
    return Array.from(document.querySelectorAll("[data-live-stream]")).filter(
      function (el) { return el.getAttribute("data-live-stream") === url; });
  }

  function ring(url) {
    streams.get(url).refreshed = Date.now();
    targets(url).forEach(function (el) { window.htmx.trigger(el, "live"); });
  }

  function pause(ms) {
    return new Promise(function (resolve) { window.setTimeout(resolve, ms); });
  }

  async function read(url, state) {
    // HX-Request: a background request, not the person's activity (SessionTimeoutMiddleware).
    const headers = { Accept: "text/event-stream", "HX-Request": "true" };
    if (state.last !== null) headers["Last-Event-ID"] = state.last;
    const response = await fetch(url, { headers: headers, credentials: "same-origin" });
    if (response.status === 429) {
      // As many streams open as this account may (other tabs): polling meanwhile, the next
      // attempt when the server says (Retry-After), not every RETRY_MS.
      state.wait = (parseInt(response.headers.get("Retry-After"), 10) || 0) * 1000;
    }
    const type = response.headers.get("Content-Type") || "";
    if (!response.ok || !response.body || type.indexOf("text/event-stream") !== 0) return;
    state.open = true;
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const chunk = await reader.read();
      if (chunk.done) return;
      buffer += chunk.value.replace(/\r\n?/g, "\n");
      let end;
      let news = false;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const lines = buffer.slice(0, end).split("\n");
        buffer = buffer.slice(end + 2);
        lines.forEach(function (line) {
          if (line.indexOf("id:") === 0) state.last = line.slice(3).trim();
          if (line.indexOf("data:") === 0) news = true;
        });
      }
      if (news) ring(url);
    }
  }

  async function follow(url) {
    const state = streams.get(url);
    while (targets(url).length) {
      try {
        await read(url, state);
      } catch (error) {
        // a lost connection: polling covers the gap, the next attempt resumes
      }
      state.open = false;
      await pause(Math.max(RETRY_MS, state.wait));
      state.wait = 0;
    }
    streams.delete(url);
  }

  function scan() {
    document.querySelectorAll("[data-live-stream]").forEach(function (el) {
      const url = el.getAttribute("data-live-stream");
      if (!streams.has(url)) {
        streams.set(url, { open: false, last: null, refreshed: Date.now(), wait: 0 });
        follow(url);
      }
    });
  }

  // A poll (htmx issues it with no triggering event) is dropped while the stream is open,
  // unless HOLD_MS passed without a refresh.
  document.addEventListener("htmx:confirm", function (evt) {
    const el = evt.detail.elt;
    const url = el && el.getAttribute ? el.getAttribute("data-live-stream") : null;
    const state = url ? streams.get(url) : null;
    if (!state || !state.open || evt.detail.triggeringEvent) return;
    if (Date.now() - state.refreshed < HOLD_MS) {
      evt.preventDefault();
    } else {
      state.refreshed = Date.now();
    }
  });
  document.addEventListener("DOMContentLoaded", scan);
  document.addEventListener("htmx:load", scan);
})();
