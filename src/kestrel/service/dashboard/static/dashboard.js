/* The admin page of kestrel-py (docs/dashboard.md).

   It polls the server's figures once a second (/dashboard/overview.json, or on a queue's page
   /dashboard/queue.json) and draws them. Every string from the server reaches the page as text
   (textContent, or an attribute set through the DOM), never as HTML, so a queue named like markup
   stays a name. Only the rows of the queue table in view are drawn, so 10,000 queues scroll,
   sort and filter as ten do. */

(function () {
  "use strict";

  const POLL_MS = 1000;
  const TIMEOUT_MS = 4000;
  const ROW_PX = 30; // the table's row height (--row in dashboard.css) until a drawn row is measured
  const OVERSCAN = 8; // rows drawn above and below the ones in view
  const UNLIMITED = 2 ** 62; // a limit at least this large is no limit (the server's UNLIMITED)
  const CHART_HEIGHT = 220;
  const CHART_SECONDS = 300; // the charts' window: the server keeps about this much history
  const FILES_AT_EACH_END = 8; // a queue's page lists this many of its oldest and newest files, at most

  // ---------------------------------------------------------------------------------------------
  // Numbers a person reads

  const grouped = new Intl.NumberFormat("en-US");

  function count(n) {
    return n === null || n === undefined ? "—" : grouped.format(n);
  }

  function bytes(n) {
    if (n === null || n === undefined) return "—";
    const units = ["B", "KB", "MB", "GB", "TB", "PB"];
    let value = n;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    if (unit === 0) return value + " B";
    return value.toFixed(value < 10 ? 2 : value < 100 ? 1 : 0) + " " + units[unit];
  }

  function rate(n) {
    if (n === null || n === undefined) return "—";
    return n < 10 && n !== Math.round(n) ? n.toFixed(1) : grouped.format(Math.round(n));
  }

  function itemsPerSecond(n) {
    return n === null || n === undefined ? "—" : rate(n) + " items/s";
  }

  function duration(ms) {
    if (ms === null || ms === undefined) return "—";
    const s = ms / 1000;
    if (ms < 1) return ms === 0 ? "0 s" : Math.round(ms * 1000) + " µs";
    if (s < 1) return (ms < 10 ? ms.toFixed(1) : Math.round(ms)) + " ms";
    if (s < 60) return (s < 10 ? s.toFixed(1) : Math.floor(s)) + " s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + " min " + Math.floor(s % 60) + " s";
    const h = Math.floor(m / 60);
    if (h < 24) return h + " h " + (m % 60) + " min";
    return Math.floor(h / 24) + " d " + (h % 24) + " h";
  }

  function clock(ms) {
    return new Date(ms).toLocaleTimeString("en-GB");
  }

  function dateTime(ms) {
    return new Date(ms).toLocaleString("en-GB");
  }

  function compact(n) {
    if (n === null || n === undefined) return "";
    const abs = Math.abs(n);
    if (abs >= 1e9) return +(n / 1e9).toFixed(1) + "G";
    if (abs >= 1e6) return +(n / 1e6).toFixed(1) + "M";
    if (abs >= 1e3) return +(n / 1e3).toFixed(1) + "k";
    return String(+n.toFixed(1));
  }

  const FORMATS = { 2: "Kestrel 2", 3: "Kestrel 3" };

  // ---------------------------------------------------------------------------------------------
  // The DOM, as text only

  function $(id) {
    return document.getElementById(id);
  }

  function node(tag, text, className) {
    const element = document.createElement(tag);
    if (text !== undefined && text !== null) element.textContent = String(text);
    if (className) element.className = className;
    return element;
  }

  // A queue's name in a URL: UTF-8, percent-encoded, but for a name that is not UTF-8 on disk (a
  // Kestrel 2 journal's), which comes as lone surrogates U+DC80-U+DCFF, one for each byte that is
  // not: each goes as that byte (`%E9`), which the server reads back into the same name.
  // (encodeURIComponent throws on a lone surrogate: once it failed the whole overview.)
  function encodeName(name) {
    let out = "";
    for (const ch of String(name)) {
      const code = ch.charCodeAt(0);
      out += ch.length === 1 && code >= 0xdc80 && code <= 0xdcff
        ? "%" + (code - 0xdc00).toString(16).toUpperCase()
        : encodeURIComponent(ch.length === 1 && code >= 0xd800 && code <= 0xdfff ? "\ufffd" : ch);
    }
    return out;
  }

  function queueHref(name) {
    return "#/queue/" + encodeName(name);
  }

  function queueLink(name, text) {
    const a = node("a", text === undefined ? name : text);
    a.href = queueHref(name);
    return a;
  }

  function joined(nodes, separator) {
    const span = node("span");
    nodes.forEach(function (n, i) {
      if (i) span.append(separator);
      span.append(n);
    });
    return span;
  }

  /* Fill a <dl> with [label, value] pairs; a value is text or a node. */
  function facts(dl, pairs) {
    const out = [];
    for (const [label, value] of pairs) {
      out.push(node("dt", label));
      const dd = node("dd");
      if (value instanceof Node) dd.append(value);
      else dd.textContent = value === undefined || value === null ? "—" : String(value);
      out.push(dd);
    }
    dl.replaceChildren(...out);
  }

  function cells(tr, values, numeric) {
    tr.replaceChildren(...values.map(function (value, i) {
      const td = node("td", value instanceof Node ? null : value, numeric && numeric[i] ? "num" : "");
      if (value instanceof Node) td.append(value);
      return td;
    }));
    return tr;
  }

  function slug(text) {
    return String(text).toLowerCase().replace(/[^a-z]+/g, "-");
  }

  function setBadge(element, text, kind) {
    element.textContent = text;
    element.className = "badge " + slug(kind || text);
  }

  // ---------------------------------------------------------------------------------------------
  // Charts (uPlot, shipped in the package)

  const charts = {};
  window.kestrelDashboard = { charts: charts }; // for a look from the browser's console

  function makeChart(container, series, format) {
    const options = {
      width: Math.max(container.clientWidth, 300),
      height: CHART_HEIGHT,
      scales: {
        x: { time: true, range: function (u, min, max) {
          const end = max === null || max === undefined ? Date.now() / 1000 : max;
          return [end - CHART_SECONDS, end];
        } },
        y: { range: function (u, min, max) { return [0, Math.max(max || 0, 1) * 1.1]; } },
      },
      series: [{ value: function (u, v) { return v === null ? "—" : clock(v * 1000); } }].concat(
        series.map(function (s) {
          return { label: s.label, stroke: s.stroke, width: 2, spanGaps: false,
                   value: function (u, v) { return v === null || v === undefined ? "—" : format(v); } };
        })),
      axes: [{}, { size: 60, values: function (u, values) { return values.map(compact); } }],
    };
    const chart = new uPlot(options, [[]].concat(series.map(function () { return []; })), container);
    chart.container = container;
    return chart;
  }

  function chartData(history, names) {
    return [history.time.map(function (t) { return t / 1000; })].concat(
      names.map(function (name) { return history[name]; }));
  }

  window.addEventListener("resize", function () {
    for (const chart of Object.values(charts)) {
      chart.setSize({ width: Math.max(chart.container.clientWidth, 300), height: CHART_HEIGHT });
    }
  });

  // ---------------------------------------------------------------------------------------------
  // Status and the server's figures

  function statusText(d) {
    if (d.status === "NotConfigured") return "Up (no status_file: the status cannot be changed)";
    if (d.status === d.enforced_status) return d.status;
    return d.status + " (" + d.enforced_status + " is enforced until the grace period ends)";
  }

  function showStatus(d) {
    setBadge($("status"), d.status === "NotConfigured" ? "Up" : d.status);
  }

  function serverSetsText(sets) {
    if (!sets) return "none (no zookeeper setting)";
    const members = ["write", "read"].filter(function (name) { return sets[name]; });
    return (members.length ? "member of the " + members.join(" and ") + " sets" : "member of no set") +
      (sets.connected ? "" : " (ZooKeeper not connected)");
  }

  function meanTime(io) {
    if (!io || !io.count) return "none so far";
    return count(io.count) + ", " + duration(1000 * io.seconds / io.count) + " each on average";
  }

  function renderServer(d, rows) {
    const s = d.server;
    showStatus(d);
    $("version").textContent = "version " + s.version;
    $("updated").textContent = "figures of " + clock(d.time_ms);
    facts($("server-facts"), [
      ["Status", statusText(d)],
      ["Server sets", serverSetsText(d.server_sets)],
      ["Version", s.version],
      ["Uptime", duration(s.uptime * 1000) + " (since " + dateTime((s.time - s.uptime) * 1000) + ")"],
      ["Queues", count(rows.length) + " of at most " + count(d.max_queues)],
    ]);
    const protocols = ["thrift", "memcache", "text"].concat(
      Object.keys(d.connections).filter(function (p) { return ["thrift", "memcache", "text"].indexOf(p) < 0; }));
    facts($("connections"), protocols.map(function (p) {
      return [p[0].toUpperCase() + p.slice(1), count(d.connections[p] || 0)];
    }).concat([["All open", count(s.curr_connections)], ["Accepted since start", count(s.total_connections)]]));
    facts($("totals"), [
      ["Items now", count(s.curr_items) + " (" + bytes(s.bytes) + ")"],
      ["Items added", count(s.total_items)],
      ["Puts, gets, peeks", count(s.cmd_set) + ", " + count(s.cmd_get) + ", " + count(s.cmd_peek)],
      ["Gets answered, empty", count(s.get_hits) + ", " + count(s.get_misses)],
      ["Bytes read, written", bytes(s.bytes_read) + ", " + bytes(s.bytes_written)],
      ["Queues created, deleted, expired",
       count(s.queue_creates) + ", " + count(s.queue_deletes) + ", " + count(s.queue_expires)],
    ]);
    renderMemory(s, rows);
    const disk = [];
    if (d.commit_log) {
      disk.push(["Commit log", count(d.commit_log.segments) + " segments, " + bytes(d.commit_log.bytes)]);
      disk.push(["Journals awaiting a checkpoint", count(d.commit_log.journals)]);
      disk.push(["Checkpoints", count(d.commit_log.checkpoints)]);
    } else {
      disk.push(["Commit log", "off"]);
    }
    disk.push(["Journal writes", meanTime(d.journal_io.write)]);
    disk.push(["Fsyncs", meanTime(d.journal_io.fsync)]);
    disk.push(["Packs", meanTime(d.journal_io.pack)]);
    facts($("disk"), disk);
  }

  function renderMemory(s, rows) {
    if (!s.max_memory_total) {
      facts($("memory"), [["Budget", "none (max_memory_total: 0)"], ["Items' bytes", bytes(s.bytes)]]);
      return;
    }
    const paged = rows.filter(function (r) { return r.state === "paged out"; });
    const shown = paged.slice(0, 8).map(function (r) { return queueLink(r.name); });
    if (paged.length > shown.length) shown.push(document.createTextNode("and " + (paged.length - shown.length) + " more"));
    const share = Math.round(100 * s.memory_total / s.max_memory_total);
    facts($("memory"), [
      ["Held", bytes(s.memory_total) + " of " + bytes(s.max_memory_total) + " (" + share + "%)"],
      ["Paged out since start", bytes(s.memory_paged_total)],
      ["Flow control", s.flow_control ? "ON: puts are held and refused" : "off"],
      ["Time under flow control", duration(s.flow_control_ms)],
      ["Puts refused by it", count(s.flow_control_refused)],
      ["Queues paged out", shown.length ? joined(shown, ", ") : "none"],
    ]);
  }

  function renderRates(d) {
    if (!charts.rates) {
      charts.rates = makeChart($("rate-chart"), [{ label: "in", stroke: "#2457c5" }, { label: "out", stroke: "#1e7b3c" }],
                               itemsPerSecond);
    }
    charts.rates.setData(chartData(d.history, ["in", "out"]));
    const peak = function (values) {
      return values.reduce(function (m, v) { return v === null ? m : Math.max(m, v); }, 0);
    };
    const now = d.rates ? "now in " + itemsPerSecond(d.rates.in) + ", out " + itemsPerSecond(d.rates.out)
                        : "now: measuring (rates need two snapshots a second apart)";
    $("rate-caption").textContent = now + "; the highest over the last " +
      duration((d.history.time.length ? d.time_ms - d.history.time[0] : 0)) + ": in " +
      itemsPerSecond(peak(d.history.in)) + ", out " + itemsPerSecond(peak(d.history.out)) + ".";
  }

  function renderRefused(d) {
    const names = Object.keys(d.refused_queues).sort();
    $("refused-panel").hidden = names.length === 0;
    $("refused-list").replaceChildren(...names.map(function (name) {
      const li = node("li");
      li.append(queueLink(name), node("span", d.refused_queues[name], "damage"),
                node("span", "Remedy: " + d.refused_remedies[name], "remedy"));
      return li;
    }));
  }

  // ---------------------------------------------------------------------------------------------
  // The queue table: sorted, filtered, and drawn only where it is in view

  const COLUMN_KEYS = ["name", "state", "items", "bytes", "open_reads", "head_wait_ms", "in", "out", "poisoned",
                       "format", "children", "aliases"];
  const NUMERIC = COLUMN_KEYS.map(function (k) {
    return ["items", "bytes", "open_reads", "head_wait_ms", "in", "out", "poisoned"].indexOf(k) >= 0;
  });
  const table = { rows: [], view: [], key: "name", direction: 1, filter: "", pool: [], top: null, bottom: null,
                  rowPx: ROW_PX };

  function tableRows(d) {
    const at = {};
    d.columns.forEach(function (name, i) { at[name] = i; });
    const children = new Map();
    const aliases = new Map();
    for (const r of d.rows) {
      const name = r[at.name];
      const plus = name.indexOf("+");
      if (plus > 0) {
        const parent = name.slice(0, plus);
        if (!children.has(parent)) children.set(parent, []);
        children.get(parent).push(name.slice(plus + 1));
      }
    }
    for (const alias of Object.keys(d.aliases)) {
      for (const queue of d.aliases[alias]) {
        if (!aliases.has(queue)) aliases.set(queue, []);
        aliases.get(queue).push(alias);
      }
    }
    return d.rows.map(function (r) {
      const name = r[at.name];
      return {
        name: name, state: r[at.state], items: r[at.items], bytes: r[at.bytes], open_reads: r[at.open_reads],
        head_wait_ms: r[at.items] ? r[at.head_wait_ms] : null, in: r[at.in], out: r[at.out],
        poisoned: r[at.poisoned], format: r[at.format],
        children: (children.get(name) || []).sort().join(", "), aliases: (aliases.get(name) || []).sort().join(", "),
      };
    });
  }

  function compare(key, direction) {
    return function (a, b) {
      let x = a[key];
      let y = b[key];
      if (x === null || x === undefined) x = -Infinity;
      if (y === null || y === undefined) y = -Infinity;
      if (x < y) return -direction;
      if (x > y) return direction;
      return a.name < b.name ? -1 : a.name > b.name ? 1 : 0;
    };
  }

  function refilter() {
    const needle = table.filter.toLowerCase();
    const view = needle ? table.rows.filter(function (r) { return r.name.toLowerCase().indexOf(needle) >= 0; })
                        : table.rows.slice();
    view.sort(compare(table.key, table.direction));
    table.view = view;
    $("queue-count").textContent = needle ? "(" + count(view.length) + " of " + count(table.rows.length) + " match)"
                                          : "(" + count(table.rows.length) + ")";
    drawTable();
  }

  function spacer() {
    const tr = node("tr", null, "spacer");
    const td = node("td");
    td.colSpan = COLUMN_KEYS.length;
    tr.append(td);
    return tr;
  }

  function rowCells(tr) {
    while (tr.children.length < COLUMN_KEYS.length) {
      tr.append(node("td", null, NUMERIC[tr.children.length] ? "num" : ""));
    }
    return tr.children;
  }

  function fillRow(tr, r) {
    const td = rowCells(tr);
    let a = td[0].firstChild;
    if (!a || a.nodeName !== "A") {
      a = node("a");
      td[0].replaceChildren(a);
    }
    a.textContent = r.name;
    a.href = queueHref(r.name);
    td[0].title = r.name;
    td[1].textContent = r.state;
    td[1].className = "state-" + slug(r.state);
    td[2].textContent = count(r.items);
    td[3].textContent = bytes(r.bytes);
    td[4].textContent = count(r.open_reads);
    td[5].textContent = duration(r.head_wait_ms);
    td[6].textContent = rate(r.in);
    td[7].textContent = rate(r.out);
    td[8].textContent = count(r.poisoned);
    td[9].textContent = FORMATS[r.format] || "—";
    td[10].textContent = r.children;
    td[10].title = r.children;
    td[11].textContent = r.aliases;
    td[11].title = r.aliases;
  }

  function drawTable() {
    const scroller = $("table-scroll");
    const tbody = $("queues").tBodies[0];
    if (!table.top) {
      table.top = spacer();
      table.bottom = spacer();
    }
    const total = table.view.length;
    if (total === 0) {
      const tr = node("tr");
      const td = node("td", table.rows.length ? "No queue name contains that." : "No queues yet.");
      td.colSpan = COLUMN_KEYS.length;
      tr.append(td);
      tbody.replaceChildren(tr);
      return;
    }
    const px = table.rowPx;
    // Until its rows fill it, the box is as tall as they are: draw a window's worth.
    const inView = Math.ceil(Math.max(scroller.clientHeight, window.innerHeight) / px) + 2 * OVERSCAN;
    const first = Math.max(0, Math.min(Math.floor(scroller.scrollTop / px) - OVERSCAN, total - inView));
    const shown = Math.min(inView, total - first);
    while (table.pool.length < shown) table.pool.push(node("tr"));
    table.top.firstChild.style.height = first * px + "px";
    table.bottom.firstChild.style.height = (total - first - shown) * px + "px";
    const rows = table.pool.slice(0, shown);
    rows.forEach(function (tr, i) { fillRow(tr, table.view[first + i]); });
    tbody.replaceChildren(table.top, ...rows, table.bottom);
    const measured = rows[0].getBoundingClientRect().height;
    if (measured > 0 && Math.abs(measured - px) > 0.01) { // the spacers must stand for rows exactly
      table.rowPx = measured;
      drawTable();
    }
  }

  function setupTable() {
    let pending = false;
    const later = function (fn) {
      if (pending) return;
      pending = true;
      requestAnimationFrame(function () { pending = false; fn(); });
    };
    $("table-scroll").addEventListener("scroll", function () { later(drawTable); });
    $("filter").addEventListener("input", function (event) {
      table.filter = event.target.value;
      $("table-scroll").scrollTop = 0;
      later(refilter);
    });
    for (const th of document.querySelectorAll("#queues thead th")) {
      th.addEventListener("click", function () {
        const key = th.dataset.key;
        table.direction = table.key === key ? -table.direction : (NUMERIC[COLUMN_KEYS.indexOf(key)] ? -1 : 1);
        table.key = key;
        showSort();
        refilter();
      });
    }
    showSort();
  }

  function showSort() {
    for (const th of document.querySelectorAll("#queues thead th")) {
      if (th.dataset.key === table.key) th.setAttribute("aria-sort", table.direction > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
    }
  }

  function renderOverview(d) {
    table.rows = tableRows(d);
    renderServer(d, table.rows);
    renderRates(d);
    renderRefused(d);
    refilter();
  }

  // ---------------------------------------------------------------------------------------------
  // A queue's page

  function settingText(setting) {
    const v = setting.value;
    switch (setting.unit) {
      case "bytes": return v >= UNLIMITED ? "unlimited" : bytes(v);
      case "ms": return v === null ? "none" : duration(v);
      case "sync": return v === null ? "never" : v === 0 ? "always (before every answer)" : "every " + duration(v);
      case "count": return v >= UNLIMITED ? "unlimited" : count(v);
      case "flag": return v ? "yes" : "no";
      default: return v === null ? "—" : String(v);
    }
  }

  function renderQueue(d) {
    showStatus(d);
    $("version").textContent = "version " + d.version;
    $("updated").textContent = "figures of " + clock(d.time_ms);
    $("q-missing").hidden = true;
    $("q-name").textContent = d.name;
    setBadge($("q-state"), d.state);
    $("q-refused").hidden = !d.refused;
    $("q-body").hidden = !!d.refused;
    if (d.refused) {
      facts($("q-refused-facts"), [["Damage", d.refused.damage], ["Remedy", d.refused.remedy],
                                   ["File", d.refused.file], ["Offset", count(d.refused.offset)]]);
      return;
    }
    const s = d.stats;
    const r = d.rates || { in: null, out: null };
    facts($("q-now"), [
      ["State", d.state],
      ["Items", count(s.items) + " (" + bytes(s.bytes) + ")"],
      ["Open reads", count(s.open_transactions)],
      ["Readers waiting", count(s.waiters)],
      ["Head item waiting", s.items ? duration(s.head_wait_ms) : "—"],
      ["In, out", itemsPerSecond(r.in) + ", " + itemsPerSecond(r.out)],
      ["Format", FORMATS[s.journal_format] || "—"],
    ]);
    facts($("q-memory"), [
      ["In memory", count(s.mem_items) + " items, " + bytes(s.mem_bytes)],
      ["Memory share", bytes(s.memory_target)],
      ["Only on disk", bytes(s.paged_out)],
      ["Journal", bytes(s.journal_size)],
      ["Journal writable", s.read_only ? "NO: the queue is read-only until it is" : "yes"],
      ["Failed journal writes", count(s.journal_write_errors)],
    ]);
    facts($("q-totals"), [
      ["Created", dateTime(s.create_time)],
      ["Items added", count(s.total_items)],
      ["Expired, discarded", count(s.expired_items) + ", " + count(s.discarded)],
      ["Reliable reads, aborted", count(s.transactions) + ", " + count(s.canceled_transactions)],
      ["Poisoned", count(s.poisoned)],
      ["Flushes", count(s.total_flushes)],
      ["Last item taken had waited", duration(s.age)],
    ]);
    const links = [];
    if (d.fanout.parent) links.push(["Fanout child of", queueLink(d.fanout.parent)]);
    links.push(["Fanout children", d.fanout.children.length ? joined(d.fanout.children.map(function (c) { return queueLink(c); }), ", ") : "none"]);
    links.push(["Aliases writing here", d.aliases.length ? d.aliases.join(", ") : "none"]);
    if (d.error_queue) {
      const e = d.error_queue;
      const span = node("span");
      span.append(queueLink(e.name), " holds " + count(e.items) + " items (" + bytes(e.bytes) + "); after " +
                  count(e.max_errors) + " aborts an item goes there");
      links.push(["Error queue", span]);
    } else {
      links.push(["Error queue", d.poison_dropped ? "none: poison items are dropped" : "none (max_errors: 0)"]);
    }
    facts($("q-links"), links);
    if (!charts.depth) {
      charts.depth = makeChart($("q-depth-chart"), [{ label: "items", stroke: "#2457c5" }], count);
      charts.queueRates = makeChart($("q-rate-chart"), [{ label: "in", stroke: "#2457c5" }, { label: "out", stroke: "#1e7b3c" }],
                                    itemsPerSecond);
    }
    charts.depth.setData(chartData(d.history, ["items"]));
    charts.queueRates.setData(chartData(d.history, ["in", "out"]));
    const fileRow = function (f) {
      return cells(node("tr"), [f.name, f.role, f.size === null ? "deleted" : bytes(f.size), f.manifest],
                   [false, false, true, false]);
    };
    let files = d.files.map(fileRow);
    if (d.files.length > 2 * FILES_AT_EACH_END + 1) { // a long backlog: its oldest and newest files
      const middle = d.files.slice(FILES_AT_EACH_END, -FILES_AT_EACH_END);
      const size = middle.reduce(function (sum, f) { return sum + (f.size || 0); }, 0);
      const more = cells(node("tr"), ["… " + count(middle.length) + " more files", "", bytes(size), ""],
                         [false, false, true, false]);
      files = files.slice(0, FILES_AT_EACH_END).concat([more], files.slice(-FILES_AT_EACH_END));
    }
    $("q-files").replaceChildren(...files);
    $("q-readers-panel").hidden = d.readers.length === 0;
    $("q-readers").replaceChildren(...d.readers.map(function (p) {
      return cells(node("tr"), [queueLink(p.queue), count(p.head), count(p.done_above), count(p.items),
                                count(p.open_reads), count(p.tail)], [false, true, true, true, true, true]);
    }));
    $("q-settings").replaceChildren(...d.settings.map(function (setting) {
      const tr = node("tr");
      tr.append(node("th", setting.name), node("td", settingText(setting)));
      return tr;
    }));
  }

  function queueMissing(name) {
    $("q-name").textContent = name;
    setBadge($("q-state"), "not found", "refused");
    $("q-body").hidden = true;
    $("q-refused").hidden = true;
    $("q-missing").textContent = "This server has no queue of that name (it may have been deleted, or not created yet).";
    $("q-missing").hidden = false;
  }

  // ---------------------------------------------------------------------------------------------
  // Pages and polling

  let route = null;
  let timer = null;
  let generation = 0;
  let failingSince = null;
  let lastGood = null;

  function currentRoute() {
    const hash = location.hash;
    if (hash.indexOf("#/queue/") === 0) {
      const encoded = hash.slice("#/queue/".length);
      let name = encoded;
      let query = encoded;  // as the link wrote it (a name not UTF-8 does not decode)
      try {
        name = decodeURIComponent(encoded);
        query = encodeName(name);
      } catch (e) {
        // shown as it came
      }
      return { kind: "queue", name: name, url: "/dashboard/queue.json?name=" + query };
    }
    return { kind: "overview", url: "/dashboard/overview.json" };
  }

  function failed(reason) {
    if (failingSince === null) failingSince = Date.now();
    const banner = $("offline");
    banner.textContent = "The server is not answering (since " + clock(failingSince) + ": " + reason +
      "). Trying again every second; " + (lastGood ? "the figures below are from " + clock(lastGood) + "." :
                                            "no figures yet.");
    banner.hidden = false;
    document.body.classList.add("stale");
  }

  function answering() {
    failingSince = null;
    lastGood = Date.now();
    $("offline").hidden = true;
    document.body.classList.remove("stale");
  }

  async function poll() {
    const mine = generation;
    const target = route;
    const abort = new AbortController();
    const deadline = setTimeout(function () { abort.abort(); }, TIMEOUT_MS);
    let data = null;
    let missing = false;
    try {
      const reply = await fetch(target.url, { cache: "no-store", signal: abort.signal });
      if (target.kind === "queue" && reply.status === 404) missing = true;
      else if (!reply.ok) throw new Error("it answered HTTP " + reply.status);
      else data = await reply.json();
    } catch (error) {
      if (mine === generation) failed(error.name === "AbortError" ? "no answer within " + TIMEOUT_MS / 1000 + " s"
                                                                   : error.message || String(error));
    } finally {
      clearTimeout(deadline);
    }
    if (mine !== generation) return;
    if (data !== null || missing) {
      answering();
      if (missing) queueMissing(target.name);
      else if (target.kind === "queue") renderQueue(data);
      else renderOverview(data);
    }
    schedule();
  }

  function schedule() {
    clearTimeout(timer);
    timer = document.hidden ? null : setTimeout(poll, POLL_MS);
  }

  function navigate() {
    generation += 1;
    clearTimeout(timer);
    const previous = route;
    route = currentRoute();
    $("overview-page").hidden = route.kind !== "overview";
    $("queue-page").hidden = route.kind !== "queue";
    if (route.kind === "queue" && (!previous || previous.name !== route.name)) {
      for (const key of ["depth", "queueRates"]) {
        if (charts[key]) {
          charts[key].destroy();
          delete charts[key];
        }
      }
      for (const id of ["q-now", "q-memory", "q-totals", "q-links", "q-files", "q-readers", "q-settings"]) {
        $(id).replaceChildren();
      }
      $("q-name").textContent = route.name;
      document.title = "Kestrel: " + route.name;
    } else if (route.kind === "overview") {
      document.title = "Kestrel";
    }
    poll();
  }

  document.addEventListener("visibilitychange", function () {
    // Nobody looking: no polling, so a forgotten background tab costs the server nothing.
    if (document.hidden) clearTimeout(timer);
    else if (route) {
      generation += 1;
      poll();
    }
  });

  setupTable();
  window.addEventListener("hashchange", navigate);
  navigate();
})();
