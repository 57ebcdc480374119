// A person's Nostr client streaming messages for tenexd's fault tests, built on nostr-tools.
//
// stdin, one JSON object per line:
//   first line  {"relays": [url...], "secret": hex}
//   then        {"kind": n, "content": text, "tags": [[...]...], "to": [index...] (optional)}
//     signs the event now (nostr-tools finalizeEvent) and publishes it to the relays named by index
//     (every relay when "to" is absent), each until that relay says OK; a relay that is down is
//     reconnected and tried again until it answers. Prints {"id", "accepted": n} for each event.
// When stdin ends, prints {"done": true, "published": n, "retries": n} and exits.
import readline from 'node:readline'
import { finalizeEvent } from 'nostr-tools/pure'
import { Relay, useWebSocketImplementation } from 'nostr-tools/relay'
import WebSocket from 'ws'

useWebSocketImplementation(WebSocket)

const hexToBytes = (hex) => new Uint8Array(Buffer.from(hex, 'hex'))
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))
const GIVE_UP_MS = 120000

const connections = new Map()
let retries = 0

async function relayFor(url) {
  const known = connections.get(url)
  if (known && known.connected) return known
  if (known) known.close()
  const relay = await Relay.connect(url)
  connections.set(url, relay)
  return relay
}

async function publishTo(url, event) {
  const deadline = Date.now() + GIVE_UP_MS
  for (;;) {
    try {
      const relay = await relayFor(url)
      await relay.publish(event)
      return
    } catch (err) {
      if (Date.now() > deadline) throw err
      retries += 1
      connections.delete(url)
      await sleep(200)
    }
  }
}

const lines = readline.createInterface({ input: process.stdin, crlfDelay: Infinity })
let config = null
let published = 0
for await (const line of lines) {
  if (!line.trim()) continue
  const request = JSON.parse(line)
  if (config === null) {
    config = request
    continue
  }
  const event = finalizeEvent(
    { kind: request.kind ?? 11, content: request.content, tags: request.tags ?? [], created_at: Math.floor(Date.now() / 1000) },
    hexToBytes(config.secret),
  )
  const targets = (request.to ?? config.relays.map((_, index) => index)).map((index) => config.relays[index])
  await Promise.all(targets.map((url) => publishTo(url, event)))
  published += 1
  process.stdout.write(JSON.stringify({ id: event.id, accepted: targets.length }) + '\n')
}
for (const relay of connections.values()) relay.close()
process.stdout.write(JSON.stringify({ done: true, published, retries }) + '\n', () => process.exit(0))
