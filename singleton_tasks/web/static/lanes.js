// The lanes page. Every value from the store (keys, task names, run ids) is user data: it is
// only ever put in the page as text (textContent, createTextNode), never parsed as HTML.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const view = { task: "", key: "", page: 1, frame: null, selected: null, source: null };

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function seconds(value) {
    value = Math.max(0, value);
    if (value < 60) return value.toFixed(1) + "s";
    if (value < 3600) return Math.floor(value / 60) + "m" + String(Math.floor(value % 60)).padStart(2, "0") + "s";
    return Math.floor(value / 3600) + "h" + String(Math.floor((value % 3600) / 60)).padStart(2, "0") + "m";
  }

  function clock(epoch) {
    if (epoch === null || epoch === undefined || epoch === 0) return "–";
    return new Date(epoch * 1000).toLocaleTimeString();
  }

  function size(bytes) {
    if (bytes === null || bytes === undefined) return "none kept";
    return bytes === 1 ? "1 byte" : bytes + " bytes";
  }

  function generations(live) {
    if (!live || !live.length) return "none";
    return live.map((g) => (g === 0 ? "0 (the producer's copy)" : String(g))).join(", ");
  }

  const WAITER_GLYPH = { pending: "○", gated: "●", woken: "◉", phantom: "✕" };

  function holderButton(lane, holder, now) {
    const expired = holder.lease_expired ? " expired" : "";
    const button = el("button", "run holder " + holder.status + expired);
    button.type = "button";
    button.dataset.runId = holder.run_id;
    const glyph = holder.status === "executing" ? "■" : holder.status === "phantom" ? "✕" : "□";
    button.append(
      el("span", "glyph", glyph + " "),
      el("span", "run-id", holder.run_id),
      document.createTextNode(" · token …" + String(holder.token).slice(-6) + " · lease " + seconds(holder.lease_age)
        + (holder.status === "waiting_for_retry" ? " · waiting for retry" : "")),
    );
    button.addEventListener("click", () => select({ kind: "holder", lane, run: holder }));
    return button;
  }

  function waiterButton(lane, waiter) {
    const button = el("button", "run waiter " + waiter.state);
    button.type = "button";
    button.dataset.runId = waiter.run_id;
    button.append(
      el("span", "position", waiter.position + ". "),
      el("span", "glyph", (WAITER_GLYPH[waiter.state] || "?") + " "),
      el("span", "run-id", waiter.run_id),
      document.createTextNode(" · " + waiter.state + (waiter.confirmed ? "" : ", unconfirmed") + " · " + seconds(waiter.waiting)),
    );
    button.addEventListener("click", () => select({ kind: "waiter", lane, run: waiter }));
    return button;
  }

  function laneNode(lane, now) {
    const node = el("article", "lane");
    node.dataset.scope = lane.scope;
    node.dataset.key = lane.key;
    const head = el("div", "lane-head");
    const name = el("span", "lane-name");
    name.append(el("span", "lane-task", lane.scope), document.createTextNode(" · "), el("span", "lane-key", lane.key));
    head.append(
      name,
      el("span", "lane-meta", "slots " + lane.holders.length + "/" + lane.limit + " · waiters " + lane.waiters.length
        + " · token " + lane.token),
    );
    if (view.frame.allow_release && lane.waiters.length) {
      const drop = el("button", "drop-waiters", "drop " + lane.waiters.length + " waiters");
      drop.type = "button";
      drop.addEventListener("click", () => dropWaiters(lane));
      head.append(drop);
    }
    const slots = el("div", "runs slots");
    for (const holder of lane.holders) slots.append(holderButton(lane, holder, now));
    for (let free = lane.holders.length; free < lane.limit; free++) slots.append(el("span", "run slot free", "· free slot"));
    node.append(head, slots);
    if (lane.waiters.length) {
      const line = el("div", "runs waiters");
      line.append(el("span", "arrow", "waiting ›"));
      for (const waiter of lane.waiters) line.append(waiterButton(lane, waiter));
      node.append(line);
    }
    return node;
  }

  function findRun(frame, runId) {
    for (const lane of frame.keys) {
      for (const holder of lane.holders) if (holder.run_id === runId) return { kind: "holder", lane, run: holder };
      for (const waiter of lane.waiters) if (waiter.run_id === runId) return { kind: "waiter", lane, run: waiter };
    }
    return null;
  }

  function select(found) {
    view.selected = found.run.run_id;
    $("release-result").textContent = "";
    renderDetail();
  }

  function field(list, name, value) {
    list.append(el("dt", null, name), el("dd", null, value));
  }

  function renderDetail() {
    const panel = $("detail");
    if (view.selected === null || view.frame === null) { panel.hidden = true; return; }
    panel.hidden = false;
    const list = $("detail-fields");
    list.replaceChildren();
    const found = findRun(view.frame, view.selected);
    field(list, "run id", view.selected);
    if (found === null) {
      field(list, "state", "no longer on this page (settled, or filtered out)");
      $("release").hidden = true;
      return;
    }
    const { kind, lane, run } = found;
    const now = view.frame.now;
    field(list, "task", lane.scope);
    field(list, "key", lane.key);
    field(list, "key's limit", lane.limit);
    if (kind === "holder") {
      field(list, "role", "holder");
      field(list, "state", run.status.replaceAll("_", " ") + (run.lease_expired ? " (lease lapsed)" : ""));
      field(list, "fencing token", run.token);
      field(list, "admitted", clock(run.admitted_at) + " (" + seconds(now - run.admitted_at) + " ago)");
      field(list, "last seen (heartbeat)", clock(run.heartbeat_at) + " (lease age " + seconds(run.lease_age) + ")");
      field(list, "lease expires", clock(run.lease_expires_at));
      field(list, "arguments (message kept)", size(run.payload_bytes) + " (a holder is never issued again)");
    } else {
      field(list, "role", "waiter, position " + run.position);
      field(list, "state", run.state + (run.confirmed ? "" : ", enqueue not confirmed"));
      field(list, "registered", clock(run.created_at) + " (" + seconds(run.waiting) + " ago)");
      field(list, "last seen (a copy)", clock(run.seen_at));
      field(list, "reissued if unseen by", clock(run.reissue_at));
      field(list, "arguments (message kept)", size(run.payload_bytes));
    }
    field(list, "live copies (generations)", generations(run.live_generations));
    $("release").hidden = !view.frame.allow_release;
  }

  function renderHandoffs(frame) {
    const list = $("handoffs");
    list.replaceChildren();
    if (!frame.handoffs.length) { list.append(el("li", "empty", "none seen yet")); return; }
    for (const handoff of frame.handoffs) {
      const item = el("li", "handoff");
      item.append(
        el("span", "handoff-time", clock(handoff.admitted_at) + " "),
        el("span", "handoff-lane", handoff.scope + " · " + handoff.key),
        document.createTextNode(": " ),
        el("span", "handoff-released", handoff.released),
        document.createTextNode(" → "),
        el("span", "handoff-admitted", handoff.admitted),
        document.createTextNode(" · gap " + handoff.gap_min.toFixed(2) + "–" + handoff.gap_max.toFixed(2) + " s"),
      );
      list.append(item);
    }
  }

  function render(frame) {
    view.frame = frame;
    view.page = frame.page;
    $("namespace").textContent = "namespace " + frame.namespace;
    $("interval").textContent = String(frame.interval);
    $("totals").textContent = frame.totals.keys + " busy keys · " + frame.totals.holders + " holders · "
      + frame.totals.waiters + " waiters" + (frame.matched !== frame.totals.keys ? " · " + frame.matched + " match" : "");
    $("page-info").textContent = "page " + frame.page + " of " + frame.pages;
    $("page-prev").disabled = frame.page <= 1;
    $("page-next").disabled = frame.page >= frame.pages;
    $("token-field").hidden = !frame.allow_release;
    $("error").hidden = !frame.error;
    $("error").textContent = frame.error ? "store unreachable, showing the last snapshot: " + frame.error : "";
    const lanes = $("lanes");
    const nodes = frame.keys.map((lane) => laneNode(lane, frame.now));
    if (!nodes.length) nodes.push(el("p", "empty", frame.matched === 0 && frame.totals.keys ? "no key matches" : "no keys with holders or waiters"));
    lanes.replaceChildren(...nodes);
    renderHandoffs(frame);
    renderDetail();
    document.body.dataset.frames = String(Number(document.body.dataset.frames || "0") + 1);
  }

  function connect() {
    if (view.source !== null) view.source.close();
    const query = new URLSearchParams({ task: view.task, key: view.key, page: String(view.page) });
    const source = new EventSource("/api/events?" + query.toString());
    view.source = source;
    source.addEventListener("frame", (event) => {
      $("status").textContent = "live";
      $("status").className = "status live";
      render(JSON.parse(event.data));
    });
    source.addEventListener("error", () => {
      $("status").textContent = "reconnecting…";
      $("status").className = "status down";
    });
  }

  let typing = null;
  function onFilter() {
    clearTimeout(typing);
    typing = setTimeout(() => {
      view.task = $("filter-task").value;
      view.key = $("filter-key").value;
      view.page = 1;
      connect();
    }, 250);
  }

  async function release() {
    const runId = view.selected;
    const result = $("release-result");
    result.textContent = "releasing…";
    try {
      const response = await fetch("/api/release", {
        method: "POST",
        headers: { "Content-Type": "application/json", "X-Singleton-Token": $("token").value },
        body: JSON.stringify({ run_id: runId }),
      });
      const body = await response.json();
      result.textContent = response.ok
        ? "released " + body.released + (body.woke.length ? "; woke " + body.woke.join(", ") : "")
        : "refused: " + body.error;
    } catch (error) {
      result.textContent = "failed: " + error;
    }
  }

  async function dropWaiters(lane) {
    const result = $("drop-result");
    result.textContent = "dropping the waiters of " + lane.key + "…";
    try {
      const response = await fetch("/api/drop-waiters", {
        method: "POST",
        headers: { "Content-Type": "application/json", "X-Singleton-Token": $("token").value },
        body: JSON.stringify({ scope: lane.scope, key: lane.key }),
      });
      const body = await response.json();
      result.textContent = response.ok
        ? "dropped " + body.dropped.length + " waiters of " + body.key
          + (body.left.length ? "; left (admitted or settled meanwhile) " + body.left.join(", ") : "")
        : "refused: " + body.error;
    } catch (error) {
      result.textContent = "failed: " + error;
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("filter-task").addEventListener("input", onFilter);
    $("filter-key").addEventListener("input", onFilter);
    $("page-prev").addEventListener("click", () => { view.page -= 1; connect(); });
    $("page-next").addEventListener("click", () => { view.page += 1; connect(); });
    $("detail-close").addEventListener("click", () => { view.selected = null; renderDetail(); });
    $("release").addEventListener("click", release);
    connect();
  });
})();
