// nostr-tools, driven by tenexd's tests: one JSON request on stdin, JSON lines on stdout.
//
// Operations (field "op"):
//   sign      {secret, templates:[{kind, content, tags, created_at}]}   -> {events:[...]}
//   verify    {events:[...]}                                            -> {valid:[bool...], ids_match:[bool...]}
//   keys      {}                                                        -> {secret, pubkey}
//   encode    {items:[{type, ...}]}                                     -> {encoded:[string...]}
//   decode    {items:[string...]}                                       -> {decoded:[{type, data}...]}
//   publish   {relays:[url], secret, templates:[...], interval_ms, deadline_ms}
//             publishes each template (signed here) to every relay, retrying each relay until it
//             answers OK true or the deadline passes; prints {"published": id, "relay": url} per
//             success and {"failed": id, "relay": url, "error": ...} per give-up, then {"done": true}.
import { finalizeEvent, verifyEvent, getEventHash, generateSecretKey, getPublicKey } from 'nostr-tools/pure'
import { Relay, useWebSocketImplementation } from 'nostr-tools/relay'
import * as nip19 from 'nostr-tools/nip19'
import WebSocket from 'ws'

useWebSocketImplementation(WebSocket)

const bytesToHex = (bytes) => Buffer.from(bytes).toString('hex')
const hexToBytes = (hex) => new Uint8Array(Buffer.from(hex, 'hex'))
const out = (obj) => process.stdout.write(JSON.stringify(obj) + '\n')
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

async function readStdin() {
  const chunks = []
  for await (const chunk of process.stdin) chunks.push(chunk)
  return JSON.parse(Buffer.concat(chunks).toString('utf8'))
}

function sign(secret, template) {
  return finalizeEvent(
    { kind: template.kind, content: template.content, tags: template.tags ?? [], created_at: template.created_at ?? Math.floor(Date.now() / 1000) },
    hexToBytes(secret),
  )
}

function encodeItem(item) {
  switch (item.type) {
    case 'npub': return nip19.npubEncode(item.hex)
    case 'nsec': return nip19.nsecEncode(hexToBytes(item.hex))
    case 'note': return nip19.noteEncode(item.hex)
    case 'nprofile': return nip19.nprofileEncode({ pubkey: item.hex, relays: item.relays ?? [] })
    case 'nevent': return nip19.neventEncode({ id: item.hex, relays: item.relays ?? [], author: item.author, kind: item.kind })
    case 'naddr': return nip19.naddrEncode({ identifier: item.identifier, pubkey: item.author, kind: item.kind, relays: item.relays ?? [] })
    default: throw new Error(`unknown type ${item.type}`)
  }
}

function decodeItem(text) {
  const { type, data } = nip19.decode(text)
  if (data instanceof Uint8Array) return { type, data: bytesToHex(data) }
  return { type, data }
}

async function connectWithRetry(url, deadline) {
  for (;;) {
    try {
      return await Relay.connect(url)
    } catch (err) {
      if (Date.now() > deadline) throw err
      await sleep(100)
    }
  }
}

async function publishOne(state, url, event, deadline) {
  for (;;) {
    try {
      if (!state.relays[url] || !state.relays[url].connected) {
        state.relays[url] = await connectWithRetry(url, deadline)
      }
      await state.relays[url].publish(event)
      out({ published: event.id, relay: url })
      return
    } catch (err) {
      if (Date.now() > deadline) {
        out({ failed: event.id, relay: url, error: String(err) })
        return
      }
      try { state.relays[url]?.close() } catch { /* already closed */ }
      state.relays[url] = null
      await sleep(100)
    }
  }
}

async function main() {
  const request = await readStdin()
  switch (request.op) {
    case 'keys': {
      const sk = generateSecretKey()
      out({ secret: bytesToHex(sk), pubkey: getPublicKey(sk) })
      break
    }
    case 'sign':
      out({ events: request.templates.map((t) => sign(request.secret, t)) })
      break
    case 'verify':
      out({
        valid: request.events.map((e) => verifyEvent({ ...e })),
        ids_match: request.events.map((e) => getEventHash(e) === e.id),
      })
      break
    case 'encode':
      out({ encoded: request.items.map(encodeItem) })
      break
    case 'decode':
      out({ decoded: request.items.map(decodeItem) })
      break
    case 'publish': {
      const deadline = Date.now() + (request.deadline_ms ?? 20000)
      const state = { relays: {} }
      for (const template of request.templates) {
        const event = sign(request.secret, template)
        await Promise.all(request.relays.map((url) => publishOne(state, url, event, deadline)))
        if (request.interval_ms) await sleep(request.interval_ms)
      }
      for (const relay of Object.values(state.relays)) {
        try { relay?.close() } catch { /* already closed */ }
      }
      out({ done: true })
      break
    }
    default:
      throw new Error(`unknown op ${request.op}`)
  }
}

// Exit only once stdout is flushed: a pipe write is asynchronous in Node.
main().then(
  () => process.stdout.write('', () => process.exit(0)),
  (err) => { process.stderr.write(String(err?.stack ?? err) + '\n'); process.exit(1) },
)
