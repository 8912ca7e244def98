// ProcessPanel's terminal: xterm.js fed by the kernel's byte deltas (anywidget custom
// messages with binary buffers). The kernel decides what to send and when (throttle, rate
// cap, status changes: sandboxkit/notebook/panel.py); this module only renders.
//
// Messages from the kernel:
//   {type: "delta", status?}            + [bytes]   new output since the last delta
//   {type: "snapshot", view, status}    + [bytes]   the kernel's byte tail, for view `view`
// To the kernel:
//   {type: "hello", view}                           a (re)rendered view asks for a snapshot
//
// Follow mode (tail -f): the newest line stays in view; scrolling up pauses following;
// the "follow" toggle (or scrolling back to the bottom) resumes it.

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text) e.textContent = text;
  return e;
}

function bytesOf(buffers) {
  if (!buffers || !buffers.length) return null;
  const b = buffers[0];
  return new Uint8Array(b.buffer, b.byteOffset, b.byteLength);
}

async function render({ model, el: root }) {
  const [{ Terminal }, { FitAddon }, { Unicode11Addon }] = await Promise.all(
    [vendor(model, "xterm"), vendor(model, "addon-fit"), vendor(model, "addon-unicode11")]);
  const view = Math.random().toString(36).slice(2);
  root.classList.add("sandboxkit-term-root");

  const top = el("div", "sandboxkit-term-top");
  const status = el("span", "sandboxkit-status", "connecting…");
  const age = el("span", "sandboxkit-age");
  const follow = el("button", "sandboxkit-follow");
  follow.type = "button";
  top.append(status, age, follow);
  const box = el("div", "sandboxkit-term");
  box.style.height = `${model.get("rows") * 15 + 6}px`; // FitAddon fits the rows to it
  root.append(top, box);

  const term = new Terminal({
    convertEol: true, // the process writes "\n"; a terminal needs "\r\n"
    disableStdin: true,
    scrollback: model.get("scrollback"),
    rows: model.get("rows"),
    fontSize: 12,
    fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace",
    theme: { background: "#fbfbfb", foreground: "#1f1f1f", cursor: "#fbfbfb",
             selectionBackground: "#b3d4fc" },
    cursorStyle: "bar",
    cursorInactiveStyle: "none",
    allowProposedApi: true, // term.unicode (the width table) is a proposed API
  });
  const fit = new FitAddon();
  term.loadAddon(fit);
  // xterm.js's own width table is Unicode 6: an emoji takes one cell there and its glyph
  // runs over the next character. Unicode 11's gives emoji (and CJK) their two cells.
  term.loadAddon(new Unicode11Addon());
  term.unicode.activeVersion = "11";
  term.open(box);

  // -- follow mode --------------------------------------------------------------------
  let following = true;
  let programmatic = false;
  let holdTop = false; // paused before there was anything to scroll back to
  function setFollowing(on) {
    following = on;
    if (on) holdTop = false;
    follow.textContent = on ? "following ✓" : "follow ▸ (paused)";
    follow.classList.toggle("sandboxkit-follow-off", !on);
    root.dataset.following = on ? "1" : "0";
  }
  function toBottom() {
    programmatic = true;
    term.scrollToBottom();
    programmatic = false;
  }
  setFollowing(true);
  follow.addEventListener("click", () => {
    setFollowing(!following);
    if (following) {
      toBottom();
    } else {
      // xterm.js keeps a viewport at the bottom there while lines arrive; a viewport
      // scrolled up (by the user, or by this one line) stays where it is. Without it,
      // the next line would scroll the view, and following would resume by itself.
      const b = term.buffer.active;
      if (b.viewportY >= b.baseY && b.baseY > 0) {
        programmatic = true;
        term.scrollLines(-1);
        programmatic = false;
      } else if (b.viewportY >= b.baseY) {
        holdTop = true; // the screen is not full yet: hold its top once lines push it
      }
    }
  });
  term.onScroll(() => {
    if (programmatic) return;
    const b = term.buffer.active;
    if (holdTop && !following) {
      holdTop = false;
      programmatic = true;
      term.scrollToTop(); // a scroll up: xterm.js leaves the view there from now on
      programmatic = false;
      return;
    }
    const atBottom = b.viewportY >= b.baseY;
    if (atBottom !== following) setFollowing(atBottom);
  });
  // A wheel turn upwards is the clearest "I want to read back" signal.
  box.addEventListener("wheel", (e) => { if (e.deltaY < 0) setFollowing(false); },
                       { passive: true });

  function write(bytes) {
    if (!bytes || !bytes.length) return;
    const wasFollowing = following;
    term.write(bytes, () => { if (wasFollowing && following) toBottom(); });
  }

  // -- status ---------------------------------------------------------------------------
  let lastByteAt = null; // performance.now() of the kernel's "last byte" as seen here
  function setStatus(s) {
    if (!s) return;
    status.textContent = s.text;
    status.classList.toggle("sandboxkit-is-stalled", !!s.stalled);
    let badge = top.querySelector(".sandboxkit-stalled");
    if (s.stalled && !badge) {
      badge = el("span", "sandboxkit-stalled", "STALLED");
      top.insertBefore(badge, age);
    } else if (!s.stalled && badge) {
      badge.remove();
    }
    lastByteAt = s.age == null ? null : performance.now() - s.age * 1000;
    tickAge();
  }
  function tickAge() {
    age.textContent = lastByteAt == null ? " · no output yet"
      : ` · last byte ${Math.max(0, Math.round((performance.now() - lastByteAt) / 1000))}s ago`;
  }
  const ageTimer = setInterval(tickAge, 1000);

  // -- messages ---------------------------------------------------------------------------
  let synced = false; // deltas before our snapshot are already in it
  function onMessage(msg, buffers) {
    if (msg.type === "snapshot") {
      if (msg.view !== view) return;
      synced = true;
      term.reset();
      setStatus(msg.status);
      write(bytesOf(buffers));
      return;
    }
    if (msg.type === "delta" && synced) {
      setStatus(msg.status);
      write(bytesOf(buffers));
    }
  }
  model.on("msg:custom", onMessage);

  const resize = new ResizeObserver(() => {
    if (box.clientWidth > 0 && box.clientHeight > 0) {
      try { fit.fit(); } catch (e) { /* hidden by the notebook's windowing */ }
      if (following) toBottom();
    }
  });
  resize.observe(box);
  model.send({ type: "hello", view });

  return () => {
    model.off("msg:custom", onMessage);
    clearInterval(ageTimer);
    resize.disconnect();
    term.dispose();
  };
}

export default { render };
