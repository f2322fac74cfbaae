# An independent float64 reference of the Qwen3.5 forward pass (recurrent Gated DeltaNet), written
# from ../shared/docs/qwen35-spec.md with numpy only, for HF-layout (bf16) checkpoints. It answers
# "is a difference ours or the reference's?": e.g. on fixtures/tiny/hf, transformers' hf_full is
# 9.8e-4 (max abs / std) from this float64 recurrence, tensorfold 1.1e-4.
# Usage: python3 tools/reference_f64.py MODEL_DIR REFERENCE.safetensors   (needs numpy)
import glob, json, struct, sys
import numpy as np
def load_file(p):
    f=open(p,'rb'); n=struct.unpack('<Q',f.read(8))[0]; h=json.loads(f.read(n)); data=f.read(); out={}
    for k,v in h.items():
        if k=='__metadata__': continue
        a,b=v['data_offsets']; raw=data[a:b]; dt=v['dtype']
        if dt=='BF16': arr=(np.frombuffer(raw,np.uint16).astype(np.uint32)<<16).view(np.float32)
        elif dt=='F32': arr=np.frombuffer(raw,np.float32)
        elif dt=='I32': arr=np.frombuffer(raw,np.int32)
        else: continue
        out[k]=arr.reshape(v['shape'])
    return out
d = sys.argv[1]; ref = sys.argv[2]
cfg = json.load(open(f"{d}/config.json")); tc = cfg.get("text_config", cfg)
W = {}
import glob
for f in glob.glob(f"{d}/*.safetensors"):
    W.update(load_file(f))
def g(n):
    for p in ["model.language_model.", "model."]:
        if p+n in W: return W[p+n].astype(np.float64)
    raise KeyError(n)
D=tc["hidden_size"]; L=tc["num_hidden_layers"]; Hq=tc["num_attention_heads"]; Hkv=tc["num_key_value_heads"]; Dh=tc["head_dim"]
Hk=tc["linear_num_key_heads"]; Hv=tc["linear_num_value_heads"]; dk=tc["linear_key_head_dim"]; dv=tc["linear_value_head_dim"]; Kc=4
eps=tc["rms_norm_eps"]; rp=tc.get("rope_parameters",{}); theta=rp.get("rope_theta"); prf=rp.get("partial_rotary_factor",0.25); rd=int(Dh*prf)
lt = tc.get("layer_types") or ["full_attention" if (i+1)%4==0 else "linear_attention" for i in range(L)]
r = load_file(ref); ids = r["ids"].astype(int)
def rms(x,w): return x/np.sqrt((x*x).mean(-1,keepdims=True)+eps)*w
E = g("embed_tokens.weight"); T=len(ids); x = E[ids]
key_dim=Hk*dk; val_dim=Hv*dv
inv = 1.0/theta**(np.arange(0,rd,2)/rd)
def rope(v, p):
    h=rd//2; a=p*inv; c=np.cos(a); s=np.sin(a); o=v.copy()
    o[...,:h]=v[...,:h]*c - v[...,h:rd]*s; o[...,h:rd]=v[...,h:rd]*c+v[...,:h]*s; return o
silu=lambda z: z/(1+np.exp(-z))
for l in range(L):
    P=f"layers.{l}."
    u = rms(x, 1+g(P+"input_layernorm.weight"))
    if lt[l]=="linear_attention":
        A=P+"linear_attn."
        m=u@g(A+"in_proj_qkv.weight").T; z=u@g(A+"in_proj_z.weight").T; b=u@g(A+"in_proj_b.weight").T; a=u@g(A+"in_proj_a.weight").T
        cw=g(A+"conv1d.weight").reshape(m.shape[1],Kc)
        X=np.concatenate([np.zeros((Kc-1,m.shape[1])),m],0)
        y=np.stack([ (X[t:t+Kc].T*cw).sum(1) for t in range(T)]); y=silu(y)
        q=y[:,:key_dim].reshape(T,Hk,dk); k=y[:,key_dim:2*key_dim].reshape(T,Hk,dk); v=y[:,2*key_dim:].reshape(T,Hv,dv)
        q=q/np.sqrt((q*q).sum(-1,keepdims=True)+1e-6)/np.sqrt(dk); k=k/np.sqrt((k*k).sum(-1,keepdims=True)+1e-6)
        beta=1/(1+np.exp(-b)); sp=np.log1p(np.exp(a+g(A+"dt_bias"))); gg=-np.exp(g(A+"A_log"))*sp; al=np.exp(gg)
        S=np.zeros((Hv,dk,dv)); o=np.zeros((T,Hv,dv)); rr=Hv//Hk
        for t in range(T):
            for h in range(Hv):
                kk=k[t,h//rr]; qq=q[t,h//rr]
                S[h]*=al[t,h]; mem=S[h].T@kk; de=(v[t,h]-mem)*beta[t,h]; S[h]+=np.outer(kk,de); o[t,h]=S[h].T@qq
        nw=g(A+"norm.weight"); zz=z.reshape(T,Hv,dv)
        on=o/np.sqrt((o*o).mean(-1,keepdims=True)+eps)*nw*silu(zz)
        yv=on.reshape(T,val_dim)@g(A+"out_proj.weight").T
    else:
        A=P+"self_attn."
        pg=(u@g(A+"q_proj.weight").T).reshape(T,Hq,2*Dh); q=pg[...,:Dh]; gate=pg[...,Dh:]
        k=(u@g(A+"k_proj.weight").T).reshape(T,Hkv,Dh); v=(u@g(A+"v_proj.weight").T).reshape(T,Hkv,Dh)
        q=rms(q,1+g(A+"q_norm.weight")); k=rms(k,1+g(A+"k_norm.weight"))
        pos=np.arange(T)[:,None,None]
        q=np.stack([rope(q[t],t) for t in range(T)]); k=np.stack([rope(k[t],t) for t in range(T)])
        o=np.zeros((T,Hq,Dh)); grp=Hq//Hkv
        for t in range(T):
            for h in range(Hq):
                s=(k[:t+1,h//grp]@q[t,h])/np.sqrt(Dh); s=np.exp(s-s.max()); s/=s.sum(); o[t,h]=s@v[:t+1,h//grp]
        o=o/(1+np.exp(-gate)); yv=o.reshape(T,Hq*Dh)@g(A+"o_proj.weight").T
    x=x+yv
    u=rms(x,1+g(P+"post_attention_layernorm.weight"))
    x=x+(silu(u@g(P+"mlp.gate_proj.weight").T)*(u@g(P+"mlp.up_proj.weight").T))@g(P+"mlp.down_proj.weight").T
lo=rms(x,1+g("norm.weight"))@E.T
np.save("/tmp/ref64.npy", lo)
want=r["hf_full"].astype(np.float64); std=want.std()
print("hf_full vs f64:", np.abs(want-lo).max()/std)
