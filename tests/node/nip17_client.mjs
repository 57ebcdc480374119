// A person's NIP-17 client for tenexd's private-conversation tests, built on nostr-tools/nip17.
// One JSON request on stdin, one JSON object on stdout.
//
//   {"op": "converse", "relay": url, "secret": hex, "to": agent hex, "message": text,
//    "reply_to": rumor id (optional), "subject": text (optional), "want": n, "timeout_ms": n}
//     subscribes to the gift wraps addressed to the sender and waits for the relay's stored ones (EOSE),
//     sends the message the way a NIP-17 client does (nostr-tools' nip17.wrapManyEvents: a gift wrap to
//     the agent and one to the sender itself), then unwraps what comes (nip17.unwrapEvent) and waits for
//     `want` new kind-14 rumors written by the agent. Prints {sent: the sender's copy of the message,
//     wraps: [wrap ids], replies: [rumors], latency_ms}. (nostr-tools makes each copy a rumor of its
//     own, p-tagging that copy's recipient: the agent's copy has another id than the sender's.)
//   {"op": "send", ...same fields, no waiting}  -> {sent, wraps}
//   {"op": "collect", "relay": url, "secret": hex, "from": agent hex, "timeout_ms": n}
//     -> {replies: [rumors]}: every rumor from that agent in the gift wraps addressed to the sender.
//   {"op": "dump", "relay": url, "timeout_ms": n} -> {events: [...]}: every event the relay holds.
import { getPublicKey } from 'nostr-tools/pure'
import * as nip17 from 'nostr-tools/nip17'
import { Relay, useWebSocketImplementation } from 'nostr-tools/relay'
import WebSocket from 'ws'

useWebSocketImplementation(WebSocket)

const hexToBytes = (hex) => new Uint8Array(Buffer.from(hex, 'hex'))
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))
const TWO_DAYS_AND_A_BIT = 2 * 24 * 3600 + 600 // a gift wrap is dated up to two days in the past

async function readStdin() {
  const chunks = []
  for await (const chunk of process.stdin) chunks.push(chunk)
  return JSON.parse(Buffer.concat(chunks).toString('utf8'))
}

async function connect(url, deadline) {
  for (;;) {
    try {
      return await Relay.connect(url)
    } catch (err) {
      if (Date.now() > deadline) throw err
      await sleep(100)
    }
  }
}

// Subscribe to the gift wraps addressed to `secret`'s key; `onrumor` gets each one's rumor, `oneose`
// is called once the relay has sent what it had stored.
function collectRumors(relay, secret, onrumor, oneose = () => {}) {
  const me = getPublicKey(hexToBytes(secret))
  const seen = new Set()
  return relay.subscribe(
    [{ kinds: [1059], '#p': [me], since: Math.floor(Date.now() / 1000) - TWO_DAYS_AND_A_BIT }],
    {
      onevent(wrap) {
        if (seen.has(wrap.id)) return
        seen.add(wrap.id)
        try {
          onrumor(nip17.unwrapEvent(wrap, hexToBytes(secret)), wrap)
        } catch (_err) {
          // not for this key, or not a valid wrap: a client skips it
        }
      },
      oneose,
    },
  )
}

async function send(relay, req) {
  const sender = hexToBytes(req.secret)
  const replyTo = req.reply_to ? { eventId: req.reply_to } : undefined
  const wraps = nip17.wrapManyEvents(sender, [{ publicKey: req.to }], req.message, req.subject, replyTo)
  // the first wrap is the sender's own copy: its rumor is the message as sent
  const sent = nip17.unwrapEvent(wraps[0], sender)
  for (const wrap of wraps) await relay.publish(wrap)
  return { sent, wraps: wraps.map((w) => w.id) }
}

async function converse(req) {
  const deadline = Date.now() + (req.timeout_ms ?? 10000)
  const relay = await connect(req.relay, deadline + 5000)
  const replies = []
  const old = new Set()
  let stored = false
  let sentAt = 0
  let latency = null
  let done
  let caughtUp
  const finished = new Promise((resolve) => { done = resolve })
  const eose = new Promise((resolve) => { caughtUp = resolve })
  const take = (rumor) => {
    if (rumor.pubkey !== req.to || rumor.kind !== 14) return
    if (!stored) { old.add(rumor.id); return }
    if (old.has(rumor.id) || replies.some((r) => r.id === rumor.id)) return
    replies.push(rumor)
    latency = latency ?? Date.now() - sentAt
    if (replies.length >= (req.want ?? 1)) done()
  }
  const sub = collectRumors(relay, req.secret, take, () => { stored = true; caughtUp() })
  await Promise.race([eose, sleep(5000)])
  stored = true
  sentAt = Date.now()
  const result = await send(relay, req)
  const timer = setTimeout(done, Math.max(0, deadline - Date.now()))
  await finished
  clearTimeout(timer)
  sub.close()
  relay.close()
  return { ...result, replies, latency_ms: latency }
}

async function sendOnly(req) {
  const relay = await connect(req.relay, Date.now() + 10000)
  const result = await send(relay, req)
  relay.close()
  return result
}

async function collect(req) {
  const relay = await connect(req.relay, Date.now() + 10000)
  const replies = []
  const sub = collectRumors(relay, req.secret, (rumor) => {
    if (rumor.pubkey === req.from && !replies.some((r) => r.id === rumor.id)) replies.push(rumor)
  })
  await sleep(req.timeout_ms ?? 2000)
  sub.close()
  relay.close()
  return { replies }
}

async function dump(req) {
  const relay = await connect(req.relay, Date.now() + 10000)
  const events = []
  await new Promise((resolve) => {
    const timer = setTimeout(resolve, req.timeout_ms ?? 5000)
    const sub = relay.subscribe([{ limit: 100000 }], {
      onevent(event) { events.push(event) },
      oneose() { clearTimeout(timer); sub.close(); resolve() },
    })
  })
  relay.close()
  return { events }
}

const req = await readStdin()
const ops = { converse, send: sendOnly, collect, dump }
const op = ops[req.op]
if (!op) throw new Error(`unknown op ${req.op}`)
process.stdout.write(JSON.stringify(await op(req)) + '\n')
process.exit(0)
