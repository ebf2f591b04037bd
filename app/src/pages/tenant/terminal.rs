//! The instance page's terminal: the guest's serial port, read and written through the
//! API's console websocket (`/v1/vms/{uuid}/console`, authenticated by the session cookie
//! from this origin), drawn by xterm.js. The script and its stylesheet come from the
//! bundle's folder, loaded only when a tenant opens the terminal; a session is opened only
//! then too, as the console takes one session at a time.

use leptos::prelude::*;

/// Where an open terminal stands, as the page says it. Only the browser opens one.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(not(feature = "hydrate"), allow(dead_code))]
enum Phase {
    Closed,
    Connecting,
    Open,
    /// Ended, with why.
    Ended(String),
}

#[component]
pub fn Terminal(uuid: String) -> impl IntoView {
    let phase = RwSignal::new(Phase::Closed);
    // Scripts only: without them the button stays disabled and the text log below serves.
    let ready = RwSignal::new(false);
    let screen = NodeRef::<leptos::html::Div>::new();
    #[cfg(feature = "hydrate")]
    let (toggle, session) = {
        Effect::new(move |_| ready.set(true));
        let session = StoredValue::new_local(None::<wasm_bindgen::JsValue>);
        let toggle = move |_: leptos::ev::MouseEvent| {
            if let Some(s) = session.get_value() {
                xterm::close(&s);
                session.set_value(None);
                phase.set(Phase::Closed);
                return;
            }
            let Some(el) = screen.get() else {
                return;
            };
            phase.set(Phase::Connecting);
            session.set_value(Some(xterm::open(&el, &uuid, phase)));
        };
        (toggle, session)
    };
    #[cfg(feature = "hydrate")]
    on_cleanup(move || {
        if let Some(Some(s)) = session.try_get_value() {
            xterm::close(&s);
        }
    });
    #[cfg(not(feature = "hydrate"))]
    let toggle = {
        let _ = &uuid;
        move |_: leptos::ev::MouseEvent| {}
    };
    let open = move || !matches!(phase.get(), Phase::Closed);
    view! {
        <section class="terminal" data-testid="terminal" aria-labelledby="terminal-h">
            <h2 id="terminal-h">"Terminal"</h2>
            <p class="muted">"The guest's serial port: log in at its login prompt. One session at a time; the console below keeps its log."</p>
            <p>
                <button type="button" on:click=toggle disabled=move || !ready.get()
                    data-testid="terminal-toggle">
                    {move || if open() { "Close terminal" } else { "Open terminal" }}
                </button>
                " "
                <span class="muted" role="status" data-testid="terminal-status">
                    {move || match phase.get() {
                        Phase::Closed => String::new(),
                        Phase::Connecting => "Connecting…".to_string(),
                        Phase::Open => "Connected.".to_string(),
                        Phase::Ended(why) => format!("Ended: {why}."),
                    }}
                </span>
            </p>
            <div class="term" node_ref=screen data-testid="terminal-screen" class:shown=open></div>
        </section>
    }
}

#[cfg(feature = "hydrate")]
mod xterm {
    use super::Phase;
    use leptos::prelude::*;
    use wasm_bindgen::JsCast;
    use wasm_bindgen::prelude::*;

    // xterm.js draws with `<style>` elements it makes itself, which the page's CSP
    // (`style-src 'self' 'nonce-…'`) admits only with the page's nonce: while it builds
    // its screen, the styles it makes get the nonce the page's own scripts carry.
    #[wasm_bindgen(inline_js = r#"
let loading = null;
function load(base) {
  if (window.Terminal) return Promise.resolve();
  if (!loading) {
    loading = new Promise((ok, fail) => {
      const css = document.createElement('link');
      css.rel = 'stylesheet';
      css.href = base + 'xterm.css';
      document.head.appendChild(css);
      const s = document.createElement('script');
      s.src = base + 'xterm.js';
      s.onload = () => ok();
      s.onerror = () => { loading = null; fail(new Error('xterm.js could not be loaded')); };
      document.head.appendChild(s);
    });
  }
  return loading;
}
export function open_terminal(el, uuid, say) {
  const own = document.querySelector('link[rel="stylesheet"][href$="/passage.css"]');
  const base = own ? own.getAttribute('href').replace(/passage\.css$/, '') : '/pkg/';
  const nonce = (document.querySelector('script[nonce]') || {}).nonce || '';
  const session = { ws: null, term: null, closed: false };
  load(base).then(() => {
    if (session.closed) return;
    const make = Document.prototype.createElement;
    Document.prototype.createElement = function (tag, opts) {
      const e = make.call(this, tag, opts);
      if (nonce && String(tag).toLowerCase() === 'style') e.nonce = nonce;
      return e;
    };
    let term;
    try {
      term = new window.Terminal({ cursorBlink: true, rows: 24, cols: 80, scrollback: 5000 });
      term.open(el);
    } finally {
      Document.prototype.createElement = make;
    }
    session.term = term;
    const scheme = location.protocol === 'https:' ? 'wss://' : 'ws://';
    const ws = new WebSocket(scheme + location.host + '/v1/vms/' + encodeURIComponent(uuid) + '/console');
    ws.binaryType = 'arraybuffer';
    session.ws = ws;
    let opened = false;
    ws.onopen = () => { opened = true; say('open', ''); term.focus(); };
    ws.onmessage = (e) => term.write(typeof e.data === 'string' ? e.data : new Uint8Array(e.data));
    ws.onclose = (e) => {
      if (session.closed) return;
      say('ended', e.reason || (opened ? 'the connection closed' :
        'could not connect: the VM must be running, and another session may be open'));
    };
    const enc = new TextEncoder();
    term.onData((d) => { if (ws.readyState === 1) ws.send(enc.encode(d)); });
  }).catch((e) => say('ended', String((e && e.message) || e)));
  return session;
}
export function close_terminal(session) {
  session.closed = true;
  if (session.ws) session.ws.close(1000);
  if (session.term) session.term.dispose();
}
"#)]
    extern "C" {
        fn open_terminal(el: &JsValue, uuid: &str, say: &JsValue) -> JsValue;
        fn close_terminal(session: &JsValue);
    }

    /// Opens a terminal in `el` on the VM's console; `phase` follows the session.
    pub fn open(el: &web_sys::HtmlDivElement, uuid: &str, phase: RwSignal<Phase>) -> JsValue {
        let say = Closure::<dyn FnMut(String, String)>::new(move |what: String, why: String| {
            phase.set(match what.as_str() {
                "open" => Phase::Open,
                _ => Phase::Ended(why),
            });
        });
        let session = open_terminal(el.unchecked_ref(), uuid, say.as_ref());
        // Called for as long as the session lives, which JavaScript decides.
        say.forget();
        session
    }

    pub fn close(session: &JsValue) {
        close_terminal(session);
    }
}
